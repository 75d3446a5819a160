"""Build-once disk cache: content-addressed paths, atomic publication, one builder at a time.

Every expensive artifact of the data pipeline (embedded corpus, embedded tokenizer, token file)
lives at a path named by a hash of everything it depends on, so a changed input gets a new path
and a stale artifact is never reused. An artifact is built under a temporary name and renamed
into place, so a crash or a concurrent reader never sees a half-written file. Concurrent ranks
serialize on a file lock (the first builds, the rest wait and then find it complete), or, on
filesystems without working locks, on a barrier callback the caller supplies.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable
from typing import Any

from filelock import FileLock


def fingerprint(identity: Any, length: int = 16) -> str:
    """Stable short hash of a JSON-able description of an artifact's inputs."""
    blob = json.dumps(identity, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:length]


def build_once(
    path: str,
    build: Callable[[str], None],
    *,
    barrier: Callable[[], None] | None = None,
    is_builder: bool = True,
) -> str:
    """Make sure `path` exists, calling `build(tmp_path)` at most once across processes.

    `build` writes a file or a directory at the temporary path it is given; it is renamed to
    `path` only after `build` returns, so `path` existing means complete. Without a barrier,
    every process takes the file lock `<path>.lock` and builds if the artifact is still missing
    after acquiring it. With a barrier, only processes with `is_builder` (e.g. local rank 0)
    build; every process then calls `barrier()` -- all of them, even on a cache hit, so the
    collective always matches -- and reads the artifact afterwards.
    """
    if barrier is None or is_builder:
        if not os.path.exists(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with FileLock(path + ".lock"):
                if not os.path.exists(path):
                    write_atomically(path, build)
    if barrier is not None:
        barrier()
    if not os.path.exists(path):
        raise RuntimeError(
            f"cache artifact {path} is missing after the barrier: no process built it. Pass "
            "is_builder=True on one process per machine (local rank 0) when passing a barrier"
        )
    return path


def write_atomically(path: str, build: Callable[[str], None]) -> None:
    """`build(tmp)` writes a file or directory at a temporary name, then it replaces `path` in one
    rename: readers see the old content or the new, never a partial one (a crash leaves `path` alone)."""
    tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        build(tmp)
        os.rename(tmp, path)  # atomic on POSIX (a file replaces a file; build_once's lock keeps dirs new)
    except BaseException:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        elif os.path.exists(tmp):
            os.remove(tmp)
        raise
