"""Build-once disk cache: content-addressed paths, atomic publication, one builder at a time.

Every expensive artifact of the data pipeline (embedded corpus, embedded tokenizer, the token
shards of a local corpus) is a directory named by a hash of everything it depends on, so a
changed input gets a new path and a stale artifact is never reused. It is built in a temporary
directory and renamed into place by `checkpoint/atomic.py` (the one home of atomic writes), so a
crash or a concurrent reader never sees a half-written one. Concurrent processes serialize on a
file lock: the first builds, the rest wait and then find it complete.
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


def build_once(path: str, build: Callable[[str], None]) -> str:
    """Make sure the directory `path` exists, calling `build(tmp_dir)` at most once across processes.

    `build` fills the empty temporary directory it is given, which becomes `path` only after
    `build` returns, so `path` existing means complete.
    """
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with FileLock(path + ".lock"):
            if not os.path.exists(path):
                with atomic_directory(path) as tmp:
                    build(str(tmp))
    return path
