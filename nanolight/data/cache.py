"""Build-once disk cache: content-addressed paths, atomic publication, one builder at a time.

Every expensive artifact of the data pipeline (embedded corpus, embedded tokenizer, the token
shards of a local corpus) is a directory named by a hash of everything it depends on, so a
changed input gets a new path and a stale artifact is never reused. It is built in a temporary
directory and renamed into place by `checkpoint/atomic.py` (the one home of atomic writes), so a
crash or a concurrent reader never sees a half-written one. Concurrent ranks serialize on a file
lock (the first builds, the rest wait and then find it complete), or, on filesystems without
working locks, on a barrier callback the caller supplies.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from typing import Any

from filelock import FileLock

from nanolight.checkpoint.atomic import atomic_directory


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
    """Make sure the directory `path` exists, calling `build(tmp_dir)` at most once across processes.

    `build` fills the empty temporary directory it is given, which becomes `path` only after
    `build` returns, so `path` existing means complete. Without a barrier, every process takes
    the file lock `<path>.lock` and builds if the artifact is still missing after acquiring it.
    With a barrier, only processes with `is_builder` (e.g. local rank 0) build; every process
    then calls `barrier()` -- all of them, even on a cache hit, so the collective always
    matches -- and reads the artifact afterwards.
    """
    if barrier is None or is_builder:
        if not os.path.exists(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with FileLock(path + ".lock"):
                if not os.path.exists(path):
                    with atomic_directory(path) as tmp:
                        build(str(tmp))
    if barrier is not None:
        barrier()
    if not os.path.exists(path):
        raise RuntimeError(
            f"cache artifact {path} is missing after the barrier: no process built it. Pass "
            "is_builder=True on one process per machine (local rank 0) when passing a barrier"
        )
    return path
