"""Trainer checkpoint directories on disk: atomic writes, the ``last`` pointer, RNG states.

Layout (``<root>/checkpoints/``)::

    step-<N>/model.safetensors   weights (safetensors: no pickle, mmap-able)
    step-<N>/optimizer.pt        optimizer state(s)          } torch.save, read back with
    step-<N>/trainer_state.pt    progress, schedulers, RNG,  } torch.load(weights_only=True):
                                 callbacks, loop position    } tensors and plain containers only
    last                         text file naming the newest complete step dir

That is the single-device layout (`SingleDeviceStrategy`). `Parallel3DStrategy` writes per-rank
shards plus ``index.json`` instead (``nanolight/checkpoint/sharded/``) with the same
``trainer_state.pt`` and the same directory protocol; both strategies read both layouts.

A directory is written as ``.tmp-step-<N>-<pid>``, every file fsynced, then renamed into place;
``last`` is rewritten through a temp file + ``os.replace``. A crash (even SIGKILL) during a
save therefore leaves the previous checkpoint and pointer untouched.
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from nanolight.checkpoint.sharded.writer import fsync_path

LAST_POINTER = "last"


@contextmanager
def atomic_checkpoint_dir(final: Path) -> Iterator[Path]:
    """Yield a temp dir next to ``final``; on success fsync it and rename it to ``final``."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
        for f in tmp.iterdir():
            fsync_path(f)
        publish_directory(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def publish_directory(tmp: Path, final: Path) -> None:
    """Rename the finished (files already fsynced) ``tmp`` to ``final``, durably.

    Re-saving an existing ``final`` moves the old one aside first, so at every instant one
    complete directory carries the name."""
    fsync_path(tmp)
    if final.exists():
        trash = final.parent / f".trash-{final.name}-{os.getpid()}"
        os.replace(final, trash)
        os.replace(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_path(final.parent)


def write_last_pointer(checkpoint_dir: Path) -> None:
    """Atomically point ``<parent>/last`` at ``checkpoint_dir`` (its name, relative)."""
    checkpoint_dir = Path(checkpoint_dir)
    pointer = checkpoint_dir.parent / LAST_POINTER
    tmp = pointer.with_name(f".{LAST_POINTER}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(checkpoint_dir.name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, pointer)
    fsync_path(pointer.parent)


def resolve_checkpoint(path: str | Path) -> Path | None:
    """A step dir, or a ``last`` pointer file / a dir containing one -> the step dir (None if absent)."""
    path = Path(path)
    if path.is_dir() and (path / LAST_POINTER).is_file() and not any(path.glob("*.safetensors")):
        path = path / LAST_POINTER
    if path.is_file():
        target = path.parent / path.read_text().strip()
        return target if target.is_dir() else None
    return path if path.is_dir() else None


def _dedupe_shared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied embeddings): save copies instead."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for name, tensor in state.items():
        tensor = tensor.detach()
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        out[name] = tensor.clone().contiguous() if key in seen else tensor.contiguous()
        seen.add(key)
    return out


def save_model_file(path: Path, state: dict[str, torch.Tensor]) -> None:
    save_file({k: v.cpu() for k, v in _dedupe_shared(state).items()}, str(path))


def load_model_file(path: Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    if not Path(path).is_file():
        raise FileNotFoundError(f"no model weights at {path}: not a nanolight checkpoint directory?")
    return load_file(str(path), device=str(device))


def save_torch_file(path: Path, obj: Any) -> None:
    torch.save(obj, path)


def load_torch_file(path: Path, device: torch.device | str = "cpu") -> Any:
    return torch.load(path, map_location=device, weights_only=True)


# ---- RNG state as tensors/lists (weights_only-loadable) ------------------------------------
def capture_rng_state() -> dict[str, Any]:
    """Every RNG the training touches: python, numpy, torch CPU and (if present) all CUDA devices."""
    version, internal, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [np_name, torch.from_numpy(np_keys.astype(np.int64)), np_pos, np_has_gauss, np_gauss],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
