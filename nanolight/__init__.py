"""nanolight: a Lightning-style trainer over a nanotron-style 3D-parallel core.

from nanolight import NanoTrainer, NanoModule, Callback
model = nanolight.load_pretrained("path/to/checkpoint")
"""

from nanolight.callbacks import Callback
from nanolight.checkpoint.pretrained import load_pretrained, save_pretrained
from nanolight.module import NanoModule
from nanolight.trainer import NanoTrainer

__version__ = "0.1.0"

__all__ = ["Callback", "NanoModule", "NanoTrainer", "load_pretrained", "save_pretrained", "__version__"]
