"""nanolight: a Lightning-style trainer over a nanotron-style 3D-parallel core.

import nanolight as L                      # a Lightning program ports by renaming
trainer = L.NanoTrainer(max_epochs=3)
trainer.fit(module, datamodule=dm)          # module: L.NanoModule, dm: L.NanoDataModule
model = nanolight.load_pretrained("path/to/checkpoint")
"""

import os

from lightning_utilities.core.rank_zero import rank_zero_only

if getattr(rank_zero_only, "rank", None) is None:  # the strategy sets it again once it knows
    rank_zero_only.rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))

from nanolight.callbacks import Callback  # noqa: E402
from nanolight.checkpoint.pretrained import load_pretrained, save_pretrained  # noqa: E402
from nanolight.module import NanoDataModule, NanoModule  # noqa: E402
from nanolight.seed import seed_everything  # noqa: E402
from nanolight.trainer import NanoTrainer  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "Callback",
    "NanoDataModule",
    "NanoModule",
    "NanoTrainer",
    "load_pretrained",
    "save_pretrained",
    "seed_everything",
    "__version__",
]
