"""Atomic directories and files: what nanolight writes is complete or absent, never half-written.

Every checkpoint, model directory and pointer goes through here. A directory is built under a
temporary sibling (``.tmp-<name>``), its files are fsynced, then it is renamed into place, and
only then does a ``last`` pointer move (itself replaced with ``os.replace``). Renames are atomic
on POSIX filesystems, so a crash or SIGKILL at any moment leaves the previous directory or the
new complete one. The temporaries a killed writer leaves behind are removed by `remove_stale`
(at the next save into the same parent, and when a run starts).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

TMP_PREFIX, TRASH_PREFIX = ".tmp-", ".trash-"
LAST_POINTER = "last"


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's entry list: makes renames durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_dir_for(final: Path) -> Path:
    """The temporary sibling `final` is built in (the same name on every rank of a job)."""
    return Path(final).parent / f"{TMP_PREFIX}{Path(final).name}"


def remove_stale(parent: Path) -> list[Path]:
    """Remove the temporary and trash directories that killed writers left in `parent`."""
    stale = [p for p in Path(parent).glob(".*") if p.name.startswith((TMP_PREFIX, TRASH_PREFIX))]
    for path in stale:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return stale


def check_target(final: Path, overwrite: bool) -> None:
    """Refuse to replace a non-empty directory (another model, another run) unless `overwrite`."""
    final = Path(final)
    if final.exists() and not final.is_dir():
        raise FileExistsError(f"save path {final} exists and is not a directory; choose another path")
    if not overwrite and final.is_dir() and any(final.iterdir()):
        held = ", ".join(sorted(p.name for p in final.iterdir())[:5])
        raise FileExistsError(
            f"save path {final} already holds files ({held}); refusing to replace them. "
            "Pass --overwrite (overwrite=True) to replace it, or choose another path"
        )


def publish(tmp: Path, final: Path) -> None:
    """Rename the finished `tmp` (its files already fsynced) to `final`, durably. Replacing an
    existing `final` moves it aside first, so at every instant one complete directory has the name."""
    fsync_path(tmp)
    if final.exists():
        trash = final.parent / f"{TRASH_PREFIX}{final.name}-{os.getpid()}"
        os.replace(final, trash)
        os.replace(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_path(final.parent)


@contextmanager
def atomic_directory(final: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary directory that becomes `final` only if the block succeeds."""
    final = Path(final).absolute()
    check_target(final, overwrite)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir_for(final)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        for file in tmp.iterdir():
            fsync_path(file)
        publish(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_directory(path: str | Path) -> None:
    """Remove a directory without ever leaving a half-deleted one under its name: rename it to a
    ``.trash-`` sibling first (which `remove_stale` cleans up after a crash). A file is unlinked."""
    path = Path(path)
    if path.is_dir():
        trash = path.parent / f"{TRASH_PREFIX}{path.name}-{os.getpid()}"
        os.replace(path, trash)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Replace the file `path` with `text` in one step (temp file, fsync, ``os.replace``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def write_last_pointer(step_dir: str | Path) -> None:
    """Point ``<parent>/last`` at `step_dir` (its name, relative), atomically."""
    step_dir = Path(step_dir)
    atomic_write_text(step_dir.parent / LAST_POINTER, step_dir.name + "\n")


def resolve_checkpoint(path: str | Path) -> Path | None:
    """A step dir, or a ``last`` pointer (the file or the directory holding it) -> the step dir;
    None when nothing is there."""
    path = Path(path)
    if path.is_dir() and (path / LAST_POINTER).is_file() and not any(path.glob("*.safetensors")):
        path = path / LAST_POINTER
    if path.is_file():
        target = path.parent / path.read_text().strip()
        return target if target.is_dir() else None
    return path if path.is_dir() else None
