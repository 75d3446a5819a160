"""Checkpoints: the nanolight pretrained format (`pretrained.py`) and HF conversion (`hf.py`)."""

from nanolight.checkpoint.hf import convert_hf_to_nanolight, convert_nanolight_to_hf
from nanolight.checkpoint.pretrained import load_pretrained, save_pretrained

__all__ = ["convert_hf_to_nanolight", "convert_nanolight_to_hf", "load_pretrained", "save_pretrained"]
