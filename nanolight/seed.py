"""Random state: seed everything once, and capture/restore it exactly for checkpoints.

Every RNG a training run touches is here: Python's, NumPy's, torch's CPU generator and (when
initialised) every CUDA device's. The captured state holds only tensors, lists and plain values,
so a checkpoint reads it back with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch
from lightning_utilities.core.rank_zero import rank_zero_info

MAX_SEED = 2**32 - 1


def seed_everything(seed: int | None = None, workers: bool = False, verbose: bool = True) -> int:
    """Lightning's ``seed_everything``: seed python, numpy and torch (all devices) and record the
    seed in ``PL_GLOBAL_SEED`` (and ``PL_SEED_WORKERS``), so processes started later -- data
    parallel ranks re-launched by the trainer, DataLoader workers with ``workers=True`` -- derive
    theirs from it. None takes ``PL_GLOBAL_SEED`` or 0. Returns the seed."""
    if seed is None:
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    seed = int(seed)
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed {seed} is out of range [0, {MAX_SEED}]")
    if verbose:
        rank_zero_info(f"Seed set to {seed}")
    os.environ["PL_GLOBAL_SEED"] = str(seed)
    os.environ["PL_SEED_WORKERS"] = str(int(workers))
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return seed


def capture_rng_state() -> dict[str, Any]:
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
