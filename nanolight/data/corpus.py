"""The embedded default corpus: this Python installation's own standard library source.

Every machine that can run nanolight has it, it is real text (code, docstrings, comments) of a
few MB, and it needs no network -- so `python recipes/smollm.py` works out of the box. It is
written once as JSONL into the cache (one document per source file) and then read like any other
local dataset, so the embedded path exercises the same tokenize/pack/cache code as user data.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from collections.abc import Callable, Iterator

from nanolight.data.cache import build_once, fingerprint

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "__pycache__", "idle_test"}
_FORMAT = 1  # bump when the corpus layout changes, so old caches are not reused


def stdlib_files(max_bytes: int, root: str | None = None) -> Iterator[tuple[str, str]]:
    """Yield (relative path, absolute path) of stdlib .py files in sorted order, up to `max_bytes`.

    Sorted walk and whole-file cap make the corpus identical on every rank and every run.
    Test suites and third-party packages are skipped: they are not the standard library's prose.
    """
    root = root or sysconfig.get_paths()["stdlib"]
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


def embedded_corpus(
    cache_root: str,
    max_mb: float,
    *,
    barrier: Callable[[], None] | None = None,
    is_builder: bool = True,
) -> str:
    """Path of the cached JSONL corpus (`{"text", "path"}` per line), written on first use."""
    stdlib = sysconfig.get_paths()["stdlib"]
    key = fingerprint({"python": sys.version, "stdlib": stdlib, "max_mb": max_mb, "format": _FORMAT})
    path = os.path.join(cache_root, "corpus", f"stdlib-{key}.jsonl")

    def build(tmp: str) -> None:
        count = 0
        with open(tmp, "w", encoding="utf-8") as out:
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

    return build_once(path, build, barrier=barrier, is_builder=is_builder)
