"""Atomic directories and files: what nanolight writes is complete or absent, never half-written.

Every checkpoint, model directory and pointer goes through here. A directory is built under a
temporary sibling (``.tmp-<name>``), its files are fsynced, then it is renamed into place, and
only then does a ``last`` pointer move (itself replaced with ``os.replace``). Renames are atomic
on POSIX filesystems, so a crash or SIGKILL at any moment leaves the previous directory or the
new complete one. The temporaries a killed writer leaves behind are removed by `remove_stale`
(at the next save into the same parent, and when a run starts).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nanolight.errors import NanolightError

TMP_PREFIX, TRASH_PREFIX = ".tmp-", ".trash-"
LAST_POINTER = "last"
RUN_CHECKPOINTS = "checkpoints"  # where a run keeps its step directories and `last` (the recipe, Lightning)


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


def _aside(path: Path) -> Path:
    """Rename `path` to a ``.trash-`` sibling (which `remove_stale` cleans up after a crash)."""
    trash = path.parent / f"{TRASH_PREFIX}{path.name}-{os.getpid()}"
    os.replace(path, trash)
    return trash


def publish(tmp: Path, final: Path) -> None:
    """Rename the finished `tmp` (its files already fsynced) to `final`, durably. Replacing an
    existing `final` moves it aside first, so at every instant one complete directory has the name."""
    fsync_path(tmp)
    trash = _aside(final) if final.exists() else None
    os.replace(tmp, final)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
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
    """Remove a directory without ever leaving a half-deleted one under its name (it is moved
    aside first). A file is unlinked."""
    path = Path(path)
    if path.is_dir():
        shutil.rmtree(_aside(path), ignore_errors=True)
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


def try_write_text(path: str | Path, text: str) -> str | None:
    """`atomic_write_text`, or the reason it could not write (read-only, full): for a probe whose
    failure is an answer, to be agreed on by every rank."""
    try:
        atomic_write_text(path, text)
    except OSError as err:
        return err.strerror or str(err)
    return None


def write_last_pointer(step_dir: str | Path) -> None:
    """Point ``<parent>/last`` at `step_dir` (its name, relative), atomically."""
    step_dir = Path(step_dir)
    atomic_write_text(step_dir.parent / LAST_POINTER, step_dir.name + "\n")


def resolve_checkpoint(path: str | Path) -> Path | None:
    """A step dir, a ``last`` pointer (the file, the directory holding it, or a run's root whose
    ``checkpoints/`` holds it) -> the step dir; None when nothing is there. The one reading of a
    checkpoint argument: resuming, converting and `load_pretrained` all take the same paths."""
    path = Path(path)
    if path.is_dir() and (path / RUN_CHECKPOINTS / LAST_POINTER).is_file():
        path = path / RUN_CHECKPOINTS  # a run's root (the recipe's trainer.default_root_dir)
    if path.is_dir() and (path / LAST_POINTER).is_file() and not any(path.glob("*.safetensors")):
        path = path / LAST_POINTER
    if path.is_file():
        target = path.parent / path.read_text().strip()
        return target if target.is_dir() else None
    return path if path.is_dir() else None


# ---- one file, written and read back with errors that name it ------------------------------------
#
# Why a wrapper: safetensors and ``torch.load`` report a truncated or damaged file as
# ``SafetensorError: incomplete metadata`` or ``PytorchStreamReader failed reading zip archive``,
# naming no file. A user resuming a run needs to know which file is bad and what to do, so every
# read of a checkpoint file goes through `load_torch` / `open_tensors`, which raise
# `CheckpointError` naming the file. Writes honour the umask (safetensors alone writes 0600, which
# teammates and eval jobs on a shared cluster cannot read), return the file's CRC-32 (recorded
# next to it and checked when read, so damage that keeps a file's size is caught too), and say
# which file and how many bytes when the disk is full.


class CheckpointError(NanolightError, ValueError):
    """A checkpoint that cannot be read: a file is truncated or damaged. The message names it."""


class MissingCheckpointFile(CheckpointError, FileNotFoundError):
    """A file the checkpoint needs is not there."""


def with_hint(exc: CheckpointError, hint: str) -> CheckpointError:
    """The same error with `hint` appended to its message (what to do about it)."""
    return type(exc)(*exc.args[:-1], f"{exc.args[-1]}; {hint}")


_FIX = "restore the file or resume from an earlier checkpoint"


class DiskFullError(CheckpointError):
    """The filesystem ran out of space while a checkpoint file was written."""

    errno = errno.ENOSPC
    rank_specific = True


def file_crc32(path: Path, chunk: int = 16 << 20) -> str:
    """CRC-32 of a file's bytes (hex): recorded when a checkpoint is written, checked when read."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_nbytes(v) for v in obj)
    return 0


def _write(path: Path, obj: Any, write: Callable[[Path], None]) -> str:
    """`write(path)`, fsynced; returns the file's CRC-32. A full disk becomes a `DiskFullError` that
    says which file and how many bytes it needed: ``OSError`` ENOSPC, safetensors' "(os error 28)",
    or torch.save's "unexpected pos" (which names no cause) when the filesystem has less room left
    than the object needs."""
    try:
        write(path)
        fsync_path(path)
    except Exception as exc:
        needed = _nbytes(obj)
        free = shutil.disk_usage(path.parent).free if path.parent.exists() else 0
        full = getattr(exc, "errno", None) == errno.ENOSPC or "os error 28" in str(exc) or free < needed
        if not full:
            raise
        raise DiskFullError(
            f"disk full writing {path}: about {needed:,} bytes needed, {free:,} free on that filesystem; "
            "free space (or point the run at another disk) and resume",
        ) from exc
    return file_crc32(path)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def save_torch(path: Path, obj: Any) -> str:
    """`obj` must hold tensors and plain containers only (read back with ``weights_only=True``)."""
    return _write(path, obj, lambda p: torch.save(obj, p))


def save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> str:
    """A safetensors file of CPU tensors, with the permissions of any other file (the umask's, where
    safetensors alone writes 0600)."""

    def write(p: Path) -> None:
        save_file(
            {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(p), {"format": "pt"}
        )
        os.chmod(p, 0o666 & ~_umask())

    return _write(path, tensors, write)


def verify(path: Path, size: int | None = None, crc32: str | None = None) -> None:
    """The file is there, as large as written and (when recorded) with the same CRC-32."""
    require(path)
    actual = path.stat().st_size
    if size is not None and actual != size:
        raise CheckpointError(
            f"checkpoint file {path} is truncated or damaged: {actual} bytes, {size} were written; {_FIX}"
        )
    if crc32 is not None and file_crc32(path) != crc32:
        raise CheckpointError(
            f"checkpoint file {path} is damaged: its checksum differs from the one written; {_FIX}"
        )


def require(path: Path, what: str = "checkpoint file") -> Path:
    if not path.is_file():
        raise MissingCheckpointFile(f"{what} {path} is missing; {_FIX}")
    return path


def _read(path: Path, what: str, read: Callable[[Path], Any]) -> Any:
    """`read(path)`, with any failure (a truncated zip, a bad safetensors header, garbled JSON, a
    pickle of something else) turned into a `CheckpointError` that names the file."""
    try:
        return read(require(path, what))
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{what} {path} is unreadable: truncated or damaged ({exc}); {_FIX}") from exc


def load_torch(path: Path, what: str = "checkpoint file") -> Any:
    return _read(path, what, lambda p: torch.load(p, map_location="cpu", weights_only=True))


def load_json(path: Path, what: str = "checkpoint file") -> Any:
    """`path` parsed as UTF-8 JSON."""
    return _read(path, what, lambda p: json.loads(p.read_bytes().decode("utf-8")))


def open_tensors(path: Path, what: str = "checkpoint shard") -> Any:
    """A safetensors handle (``keys``, ``get_tensor``, ``get_slice``) for `path`."""
    return _read(path, what, lambda p: safe_open(str(p), framework="pt"))
