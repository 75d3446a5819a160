"""Model definitions. `LlamaForCausalLM` covers Llama and SmolLM; see `llama.py`."""

from nanolight.models.flops import flops_per_token
from nanolight.models.llama import LlamaForCausalLM, causal_lm_loss, flash_attn_available
from nanolight.models.llama_config import LlamaConfig
from nanolight.models.presets import PRESETS

__all__ = [
    "PRESETS",
    "LlamaConfig",
    "LlamaForCausalLM",
    "causal_lm_loss",
    "flash_attn_available",
    "flops_per_token",
]
