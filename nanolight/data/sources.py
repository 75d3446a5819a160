"""Where documents come from: local files (path, directory or glob) or a Hugging Face hub dataset.

Both end up as a `datasets` object whose rows hold `text_field`. Local files are recognized by
extension and read with the matching `datasets` builder; anything that is not a local path is
taken as a hub dataset name. A local-looking path that does not exist is an error right away,
not a confusing hub lookup.
"""

from __future__ import annotations

import glob
import os
from typing import Any

from nanolight.data.config import DataConfig

# extension -> (datasets builder, extra builder kwargs)
_BUILDERS: dict[str, tuple[str, dict[str, Any]]] = {
    ".jsonl": ("json", {}),
    ".json": ("json", {}),
    ".parquet": ("parquet", {}),
    # a .txt file is one document (not one per line): EOS then separates files, not lines
    ".txt": ("text", {"sample_by": "document"}),
}


def local_files(path: str) -> list[str] | None:
    """Sorted data files `path` names, or None when `path` is not local (a hub dataset name).

    Raises FileNotFoundError naming the path and the fix when it looks local but matches nothing.
    """
    expanded = os.path.expanduser(path)
    is_glob = any(c in expanded for c in "*?[")
    looks_local = (
        is_glob
        or os.path.exists(expanded)
        or expanded.startswith(("/", "./", "../"))
        or os.path.splitext(expanded)[1] in _BUILDERS
    )
    if not looks_local:
        return None
    if os.path.isdir(expanded):
        candidates = glob.glob(os.path.join(expanded, "**", "*"), recursive=True)
    elif is_glob:
        candidates = glob.glob(expanded, recursive=True)
    else:
        candidates = [expanded] if os.path.isfile(expanded) else []
    files = sorted(os.path.abspath(f) for f in candidates if os.path.splitext(f)[1] in _BUILDERS)
    if not files:
        raise FileNotFoundError(
            f"data.path={path!r} matches no data file (supported: {', '.join(_BUILDERS)}). "
            "Fix the path or glob, or use data.path=embedded or a hub dataset name"
        )
    return files


def local_identity(files: list[str]) -> list[tuple[str, int, int]]:
    """(path, size, mtime_ns) per file: any edit, addition or removal changes the cache key."""
    return [(f, os.path.getsize(f), os.stat(f).st_mtime_ns) for f in files]


def open_local(files: list[str], *, streaming: bool, cache_dir: str) -> Any:
    """One `datasets` split over local files, all of one format."""
    exts = {os.path.splitext(f)[1] for f in files}
    builders = {_BUILDERS[e][0] for e in exts}
    if len(builders) > 1:
        raise ValueError(
            f"data.path mixes file formats {sorted(exts)}; point it at files of one format (e.g. a *.jsonl glob)"
        )
    builder, kwargs = _BUILDERS[exts.pop()]
    import datasets

    return datasets.load_dataset(
        builder, data_files=files, split="train", streaming=streaming, cache_dir=cache_dir, **kwargs
    )


def open_hub(cfg: DataConfig, *, streaming: bool) -> Any:
    """`datasets.load_dataset(cfg.path, cfg.name, split=cfg.split, streaming=...)` with a fix-it error."""
    import datasets

    try:
        return datasets.load_dataset(
            cfg.path, cfg.name, split=cfg.split, revision=cfg.revision, streaming=streaming
        )
    except Exception as err:  # hub/network/config errors come in many types
        raise RuntimeError(
            f"could not load hub dataset data.path={cfg.path!r} (name={cfg.name!r}, split={cfg.split!r}): "
            f"{type(err).__name__}: {err}. Check the name, config and split, and the network; offline, "
            "use data.path=embedded or local files (a local path that does not exist is read as a hub name: "
            "check it, or write it as ./path or /abs/path)"
        ) from err


def check_text_field(columns: list[str] | None, text_field: str) -> None:
    """Fail with the available columns when `text_field` is not one of them."""
    if columns is not None and text_field not in columns:
        raise ValueError(
            f"data.text_field={text_field!r} is not a column of the dataset; available columns: "
            f"{sorted(columns)}. Set data.text_field to the one holding the document text"
        )
