"""One file of a checkpoint, written and read back with errors that name it.

Why a wrapper: safetensors and ``torch.load`` report a truncated or damaged file as
``SafetensorError: incomplete metadata`` or ``PytorchStreamReader failed reading zip archive``,
naming no file. A user resuming a run needs to know which file is bad and what to do, so every
read of a checkpoint file goes through `load_torch` / `open_tensors`, which raise
`CheckpointError` naming the file. Writes honour the umask (safetensors alone writes 0600, which
teammates and eval jobs on a shared cluster cannot read).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nanolight.checkpoint.atomic import fsync_path


class CheckpointError(ValueError):
    """A checkpoint that cannot be read: a file is truncated or damaged. The message names it."""


class MissingCheckpointFile(CheckpointError, FileNotFoundError):
    """A file the checkpoint needs is not there."""


_FIX = "restore the file or resume from an earlier checkpoint"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _readable_by_group(path: Path) -> None:
    os.chmod(path, 0o666 & ~_umask())


def save_torch(path: Path, obj: Any) -> None:
    """`obj` must hold tensors and plain containers only (read back with ``weights_only=True``)."""
    torch.save(obj, path)
    fsync_path(path)


def save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A safetensors file of CPU tensors, fsynced, with the permissions of any other file."""
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(path), {"format": "pt"})
    _readable_by_group(path)
    fsync_path(path)


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


def open_tensors(path: Path, what: str = "checkpoint shard") -> Any:
    """A safetensors handle (``keys``, ``get_tensor``, ``get_slice``) for `path`."""
    try:
        return safe_open(str(require(path, what)), framework="pt")
    except CheckpointError:
        raise
    except Exception as exc:  # safetensors raises its own error type for a bad header
        raise CheckpointError(f"{what} {path} is unreadable: truncated or damaged ({exc}); {_FIX}") from exc
