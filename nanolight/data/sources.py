"""Where documents come from: the embedded corpus, local files (path, directory or glob) or a
Hugging Face hub dataset.

All end up as a `datasets` object whose rows hold `text_field`. Local files are recognized by
extension and read with the matching `datasets` builder; anything that is not a local path is
taken as a hub dataset name. A local-looking path that does not exist is an error right away,
not a confusing hub lookup.

The embedded default corpus is this Python installation's own standard library source: every
machine that can run nanolight has it, it is real text (code, docstrings, comments) of a few
MB, and it needs no network -- so `python recipes/smollm.py` works out of the box. It is
written once as JSONL into the cache (one document per source file) and then read like any
other local file, so the embedded path exercises the same tokenize/shard/cache code as user data.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import sys
import sysconfig
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from nanolight.data.cache import build_once, fingerprint
from nanolight.data.config import DataConfig, DataError, DataNotFound

_PEEK = 1 << 16  # bytes of each text file read up front to tell a data file from garbage
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "__pycache__", "idle_test"}
_CORPUS_FORMAT = 2  # bump when the corpus layout changes, so old caches are not reused

# extension -> (datasets builder, extra builder kwargs)
_BUILDERS: dict[str, tuple[str, dict[str, Any]]] = {
    ".jsonl": ("json", {}),
    ".json": ("json", {}),
    ".parquet": ("parquet", {}),
    # a .txt file is one document (not one per line): EOS then separates files, not lines
    ".txt": ("text", {"sample_by": "document"}),
}


def local_files(path: str, key: str = "data.path") -> list[str] | None:
    """Sorted data files `path` names, or None when `path` is not local (a hub dataset name).

    Raises DataNotFound (a FileNotFoundError) naming the path and the fix when it looks local but
    matches nothing.
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
        raise DataNotFound(
            f"{key}={path!r} matches no data file (supported: {', '.join(_BUILDERS)}). "
            f"Fix the path or glob, or use {key}=embedded or a hub dataset name"
        )
    return files


def local_identity(files: list[str]) -> list[tuple[str, int, int]]:
    """(path, size, mtime_ns) per file: any edit, addition or removal changes the cache key."""
    return [(f, os.path.getsize(f), os.stat(f).st_mtime_ns) for f in files]


def check_local_file(path: str) -> None:
    """Fail with the file's name and what is wrong before `datasets` reads it.

    `datasets` reports an empty JSONL file as a bare StopIteration, a binary one as a
    UnicodeDecodeError or ArrowInvalid, a damaged parquet file as ArrowInvalid, none of them
    naming the file. A few stat calls and the first 64 KB of each file tell those apart.
    """
    ext = os.path.splitext(path)[1]
    if os.path.getsize(path) == 0:
        raise DataError(
            f"data file {path} is empty (0 bytes): it holds no documents; remove it or fix the glob"
        )
    if ext == ".parquet":
        _check_parquet(path)
        return
    with open(path, "rb") as f:
        head = f.read(_PEEK)
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as err:
        if err.start < len(head) - 3:  # a multi-byte character cut at the 64 KB mark is fine
            raise DataError(
                f"data file {path} is not UTF-8 text (byte {err.start} is {head[err.start : err.start + 1]!r}): "
                f"it is binary or in another encoding, not a {ext} file; convert it or remove it"
            ) from None
        text = head[: err.start].decode("utf-8")
    if ext in (".jsonl", ".json") and not text.strip():
        raise DataError(f"data file {path} holds only whitespace: no documents; remove it or fix the glob")
    if ext == ".jsonl":
        first = text.lstrip().split("\n", 1)[0]
        if len(first) < len(text.lstrip()) or len(head) < _PEEK:  # a whole first line was read
            try:
                row = json.loads(first)
            except json.JSONDecodeError as err:
                raise DataError(
                    f"data file {path}: its first line is not JSON ({err.msg} at column {err.colno}); a .jsonl "
                    'file holds one JSON object per line, e.g. {"text": "..."}'
                ) from None
            if not isinstance(row, dict):
                raise DataError(
                    f"data file {path}: its first line is a JSON {type(row).__name__}, not an object; a .jsonl "
                    'file holds one object per line, e.g. {"text": "..."}'
                )


def _check_parquet(path: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pq.read_metadata(path)
    except (pa.ArrowException, OSError) as err:
        raise DataError(
            f"data file {path} is not a readable parquet file ({err}); it is damaged (e.g. a partial "
            "download) or not parquet: download it again or remove it"
        ) from None


def open_local(files: list[str], *, streaming: bool, cache_dir: str, num_proc: int | None = None) -> Any:
    """One `datasets` split over local files, all of one format; each file is checked first."""
    exts = {os.path.splitext(f)[1] for f in files}
    builders = {_BUILDERS[e][0] for e in exts}
    if len(builders) > 1:
        raise ValueError(
            f"data.path mixes file formats {sorted(exts)}; point it at files of one format (e.g. a *.jsonl glob)"
        )
    for f in files:
        check_local_file(f)
    builder, defaults = _BUILDERS[exts.pop()]
    kwargs = dict(defaults)  # a copy: the table is shared
    if num_proc and num_proc > 1 and not streaming:
        kwargs["num_proc"] = num_proc  # converts the files to arrow in parallel
    import datasets

    with reading(files):  # damage past the first 64 KB surfaces here, in many exception types
        return datasets.load_dataset(
            builder, data_files=files, split="train", streaming=streaming, cache_dir=cache_dir, **kwargs
        )


@contextmanager
def reading(files: list[str]) -> Iterator[None]:
    """Around a `datasets` read of `files`: a library error becomes a DataError naming the files
    and saying what to do (our own DataErrors pass through); the readers' own log of it (on stdout
    and stderr under the recipe's logging) is silenced, so the error is said once."""
    log = logging.getLogger("datasets.packaged_modules")
    previous = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    except DataError:
        raise
    except Exception as err:
        where = files[0] if len(files) == 1 else f"one of {len(files)} files ({files[0]} ...)"
        raise DataError(
            f"could not read {where}: {type(err).__name__}: {err}. The file is damaged or not in the "
            "format its extension says; fix or remove it"
        ) from err
    finally:
        log.setLevel(previous)


def open_hub(cfg: DataConfig, *, streaming: bool, num_proc: int | None = None) -> Any:
    """`datasets.load_dataset(cfg.path, cfg.name, split=cfg.split, streaming=...)` with a fix-it error."""
    import datasets

    extra = {"num_proc": num_proc} if num_proc and num_proc > 1 and not streaming else {}
    try:
        return datasets.load_dataset(
            cfg.path, cfg.name, split=cfg.split, revision=cfg.revision, streaming=streaming, **extra
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
        raise DataError(
            f"data.text_field={text_field!r} is not a column of the dataset; available columns: "
            f"{sorted(columns)}. Set data.text_field to the one holding the document text"
        )


def stdlib_files(max_bytes: int, root: str) -> Iterator[tuple[str, str]]:
    """Yield (relative path, absolute path) of stdlib .py files in sorted order, up to `max_bytes`.

    Sorted walk and whole-file cap make the corpus identical on every rank and every run.
    Test suites and third-party packages are skipped: they are not the standard library's prose.
    """
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            full = os.path.join(dirpath, name)
            size = os.path.getsize(full)
            if total + size > max_bytes:
                return
            total += size
            yield os.path.relpath(full, root), full


def embedded_corpus(cache_root: str, max_mb: float) -> str:
    """Path of the cached JSONL corpus (`{"text", "path"}` per line), written on first use.

    It lies in a directory named by its content key, which the embedded tokenizer's key reuses."""
    stdlib = sysconfig.get_paths()["stdlib"]
    key = fingerprint({"python": sys.version, "stdlib": stdlib, "max_mb": max_mb, "format": _CORPUS_FORMAT})
    path = os.path.join(cache_root, "corpus", f"stdlib-{key}")

    def build(tmp: str) -> None:
        count = 0
        with open(os.path.join(tmp, "corpus.jsonl"), "w", encoding="utf-8") as out:
            for rel, full in stdlib_files(int(max_mb * 1e6), stdlib):
                with open(full, encoding="utf-8", errors="replace") as f:
                    text = f.read()
                if text.strip():
                    out.write(json.dumps({"text": text, "path": rel}) + "\n")
                    count += 1
        if count == 0:
            raise RuntimeError(
                f"no .py source files under {stdlib} (this Python ships without its stdlib sources?): "
                "set data.path to a local .jsonl/.txt corpus or a hub dataset instead of `embedded`"
            )

    return os.path.join(build_once(path, build), "corpus.jsonl")
