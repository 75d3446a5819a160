"""nanolight: a Lightning-style trainer over a nanotron-style 3D-parallel core.

from nanolight import NanoTrainer, NanoModule, Callback
model = nanolight.load_pretrained("path/to/checkpoint")

The top-level names load on first use (PEP 562), so that ``import nanolight.models`` brings in
the model and torch only -- not the trainer, its loggers and their dependencies (a GPU box with
just torch + transformers runs `scripts/bench_gpu.py`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Callback": "nanolight.callbacks",
    "NanoModule": "nanolight.module",
    "NanoTrainer": "nanolight.trainer",
    "load_pretrained": "nanolight.checkpoint.pretrained",
    "save_pretrained": "nanolight.checkpoint.pretrained",
}

if TYPE_CHECKING:
    from nanolight.callbacks import Callback
    from nanolight.checkpoint.pretrained import load_pretrained, save_pretrained
    from nanolight.module import NanoModule
    from nanolight.trainer import NanoTrainer


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    raise AttributeError(f"module 'nanolight' has no attribute {name!r}")


__all__ = ["Callback", "NanoModule", "NanoTrainer", "load_pretrained", "save_pretrained", "__version__"]
