"""Causal-LM pretraining assembled from the library: config schema, module, and `run`.

`recipes/smollm.py` is a thin Hydra front end over `run(load_config(cfg))`.
"""

from nanolight.pretrain.config import PretrainConfig, load_config
from nanolight.pretrain.module import CausalLMPretrain
from nanolight.pretrain.run import run
from nanolight.pretrain.schema import ConfigError

__all__ = ["CausalLMPretrain", "ConfigError", "PretrainConfig", "load_config", "run"]
