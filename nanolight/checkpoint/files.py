"""One file of a checkpoint, written and read back with errors that name it.

Why a wrapper: safetensors and ``torch.load`` report a truncated or damaged file as
``SafetensorError: incomplete metadata`` or ``PytorchStreamReader failed reading zip archive``,
naming no file. A user resuming a run needs to know which file is bad and what to do, so every
read of a checkpoint file goes through `load_torch` / `open_tensors`, which raise
`CheckpointError` naming the file. Writes honour the umask (safetensors alone writes 0600, which
teammates and eval jobs on a shared cluster cannot read), return the file's CRC-32 (recorded
next to it and checked when read, so damage that keeps a file's size is caught too), and say
which file and how many bytes when the disk is full.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nanolight.checkpoint.atomic import fsync_path
from nanolight.errors import NanolightError


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


@contextmanager
def _writing(path: Path, obj: Any) -> Any:
    """Turn a full disk into a `DiskFullError` that says which file and how many bytes it needed:
    ``OSError`` ENOSPC, safetensors' "(os error 28)", or torch.save's "unexpected pos" (which
    names no cause) when the filesystem has less room left than the object needs."""
    try:
        yield
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


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def save_torch(path: Path, obj: Any) -> str:
    """`obj` must hold tensors and plain containers only (read back with ``weights_only=True``).
    Fsynced; returns its CRC-32."""
    with _writing(path, obj):
        torch.save(obj, path)
        fsync_path(path)
    return file_crc32(path)


def save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> str:
    """A safetensors file of CPU tensors, fsynced, with the permissions of any other file (the
    umask's, where safetensors alone writes 0600). Returns its CRC-32."""
    with _writing(path, tensors):
        save_file(
            {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(path), {"format": "pt"}
        )
        os.chmod(path, 0o666 & ~_umask())
        fsync_path(path)
    return file_crc32(path)


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


def load_torch(path: Path, what: str = "checkpoint file", device: str | torch.device = "cpu") -> Any:
    try:
        return torch.load(require(path, what), map_location=device, weights_only=True)
    except CheckpointError:
        raise
    except Exception as exc:  # a truncated zip, a pickle of something else: name the file
        raise CheckpointError(f"{what} {path} is truncated or damaged ({exc}); {_FIX}") from exc


def load_json(path: Path, what: str = "checkpoint file") -> Any:
    """`path` parsed as UTF-8 JSON; a truncated or garbled file is an error naming it."""
    try:
        return json.loads(require(path, what).read_bytes().decode("utf-8"))
    except CheckpointError:
        raise
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(
            f"{what} {path} is truncated or damaged (not UTF-8 JSON: {exc}); {_FIX}"
        ) from exc


def open_tensors(path: Path, what: str = "checkpoint shard") -> Any:
    """A safetensors handle (``keys``, ``get_tensor``, ``get_slice``) for `path`."""
    try:
        return safe_open(str(require(path, what)), framework="pt")
    except CheckpointError:
        raise
    except Exception as exc:  # safetensors raises its own error type for a bad header
        raise CheckpointError(f"{what} {path} is unreadable: truncated or damaged ({exc}); {_FIX}") from exc


class InMemoryTensors:
    """Tensors already in memory (a one-process ``optimizer.pt``) behind the safetensors handle
    interface (`open_tensors`) the reader uses."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def get_tensor(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def get_slice(self, key: str) -> torch.Tensor:
        return self.tensors[key]
