"""nanolight: a Lightning-style trainer over a nanotron-style 3D-parallel core.

import nanolight as L                      # a Lightning program ports by renaming
trainer = L.NanoTrainer(max_epochs=3)
trainer.fit(module, datamodule=dm)          # module: L.NanoModule, dm: L.NanoDataModule
model = nanolight.load_pretrained("path/to/checkpoint")

The top-level names load on first use (PEP 562), so that ``import nanolight.models`` brings in
the model and torch only -- not the trainer, its loggers and their dependencies (a GPU box with
just torch + transformers runs `scripts/bench_gpu.py`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from nanolight.parallel.environment import launched_rank

try:  # rank-zero helpers print on rank 0 only, even before a strategy knows the rank
    from lightning_utilities.core.rank_zero import rank_zero_only

    if getattr(rank_zero_only, "rank", None) is None:  # the strategy sets it again once it knows
        rank_zero_only.rank = launched_rank()
except ImportError:  # the model-only install: nothing here prints through them
    pass

__version__ = "0.1.0"

_EXPORTS = {
    "Callback": "nanolight.callbacks",
    "NanoDataModule": "nanolight.module",
    "NanoModule": "nanolight.module",
    "NanoTrainer": "nanolight.trainer",
    "load_pretrained": "nanolight.models.pretrained",
    "save_pretrained": "nanolight.models.pretrained",
    "seed_everything": "nanolight.seed",
}

if TYPE_CHECKING:
    from nanolight.callbacks import Callback
    from nanolight.models.pretrained import load_pretrained, save_pretrained
    from nanolight.module import NanoDataModule, NanoModule
    from nanolight.seed import seed_everything
    from nanolight.trainer import NanoTrainer


_SUBPACKAGES = ("callbacks", "core", "demos", "loggers", "profilers", "utilities")  # ``L.demos.BoringModel``

_LOGO = """
   +---------------------------------------+
   |   nanolight  --  Lightning's loop,    |
   |   nanotron's 3D parallelism           |
   +---------------------------------------+
"""


def cli_lightning_logo() -> None:
    """Print nanolight's banner (Lightning's example scripts call this first)."""
    print(_LOGO)


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        return importlib.import_module(f"nanolight.{name}")
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    raise AttributeError(f"module 'nanolight' has no attribute {name!r}")


__all__ = [
    "Callback",
    "NanoDataModule",
    "NanoModule",
    "NanoTrainer",
    "cli_lightning_logo",
    "load_pretrained",
    "save_pretrained",
    "seed_everything",
    "__version__",
]
