"""Model definitions. `LlamaForCausalLM` covers Llama and SmolLM; see `llama.py`."""

from nanolight.models.llama import LlamaForCausalLM, causal_lm_loss, flash_attn_available
from nanolight.models.llama_config import PRESETS, LlamaConfig, flops_per_token

__all__ = [
    "PRESETS",
    "LlamaConfig",
    "LlamaForCausalLM",
    "causal_lm_loss",
    "flash_attn_available",
    "flops_per_token",
]
