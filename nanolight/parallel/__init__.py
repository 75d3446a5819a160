"""The 3D-parallel core: process groups (`ParallelContext`), tensor parallelism
(`tensor_parallel/`), pipeline parallelism (`pipeline/`, its messages through `p2p.py`), data
parallelism (`data_parallel.py`) and the ZeRO-1 optimizer (`zero.py`). Usable without the trainer;
imports nothing from it.

The two names load on first use (PEP 562): ``import nanolight`` reads the launched rank from
`environment.py`, which needs no torch, and so must not bring in the process groups."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nanolight.parallel.config import ParallelConfig
    from nanolight.parallel.context import ParallelContext

_EXPORTS = {"ParallelConfig": "nanolight.parallel.config", "ParallelContext": "nanolight.parallel.context"}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'nanolight.parallel' has no attribute {name!r}")


__all__ = ["ParallelConfig", "ParallelContext"]
