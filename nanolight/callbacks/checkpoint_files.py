"""Filesystem side of `ModelCheckpoint`: where checkpoints go, what exists, safe removal.

Kept apart from the callback so the selection logic (top-k, triggers) reads on its own. Every
decision that depends on the filesystem is taken on global rank zero and broadcast, so all
ranks agree on names (they all write the same directory).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from nanolight.checkpoint.atomic import LAST_POINTER, TRASH_PREFIX, resolve_checkpoint


def default_dirpath(trainer: Any) -> str:
    """Lightning's rule: ``<save_dir>/<name>/<version>/checkpoints`` of the first logger (its
    ``save_dir`` falling back to ``default_root_dir``; an int version reads ``version_<n>``),
    else ``<default_root_dir>/checkpoints``."""
    if trainer.loggers:
        logger = trainer.loggers[0]
        save_dir = logger.save_dir if logger.save_dir is not None else trainer.default_root_dir
        version = logger.version
        version = version if isinstance(version, str) else f"version_{version}"
        return os.path.join(str(save_dir), str(logger.name), version, "checkpoints")
    return os.path.join(str(trainer.default_root_dir), "checkpoints")


def exists(trainer: Any, path: str) -> bool:
    """Whether `path` exists, as global rank zero sees it (the same answer on every rank)."""
    local = os.path.exists(path) if trainer.is_global_zero else False
    return bool(trainer.strategy.broadcast(local, src=0))


def pointer_target(dirpath: str | None) -> str | None:
    """The checkpoint directory ``<dirpath>/last`` names, if any (never to be deleted)."""
    if not dirpath:
        return None
    target = resolve_checkpoint(Path(dirpath) / LAST_POINTER)
    return str(target) if target is not None else None


def is_inside(path: str, dirpath: str | None) -> bool:
    """Only checkpoints directly in this callback's `dirpath` are ever removed (as Lightning,
    which leaves files outside its directory alone)."""
    return dirpath is not None and Path(path).absolute().parent == Path(dirpath).absolute()


def remove_checkpoint_dir(path: str) -> None:
    """Remove a checkpoint directory without ever leaving a half-deleted one under its name:
    rename it to a ``.trash-`` sibling first (which `remove_stale` cleans up after a crash)."""
    p = Path(path)
    if not p.exists():
        return
    if p.is_dir():
        trash = p.parent / f"{TRASH_PREFIX}{p.name}-{os.getpid()}"
        os.replace(p, trash)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)
