"""Training FLOPs per token of a Llama model, for throughput and MFU.

    flops_per_token = 6 * N_matmul + 12 * L * seq_len * head_dim * n_heads

N_matmul counts every weight that takes part in a matmul: per layer the fused qkv, o, fused
gate_up and down projections, plus the lm_head (hidden x vocab) even when it is tied to the
embedding, because the output matmul is done either way. The embedding lookup and the norm
weights do no matmul and are left out. The factor 6 is 2 (multiply + add) x 3 (forward, and
backward w.r.t. activations and w.r.t. weights).

The attention term is the QK^T and AV score matmuls, which have no weights: per layer and
token 2 matmuls x 2 FLOPs x seq_len x (n_heads * head_dim) forward, x3 for training = 12.
This is the formula of PaLM (Chowdhery et al. 2022, appendix B) and of Chinchilla
(Hoffmann et al. 2022, appendix F, up to its softmax/embedding extras), as nanoGPT's
`estimate_mfu` uses it. No causal halving is applied: the masked upper triangle is counted
as computed, like nanoGPT and PaLM, so MFU figures stay comparable with theirs.
"""

from __future__ import annotations

from nanolight.models.llama_config import LlamaConfig


def matmul_params(config: LlamaConfig) -> int:
    """Weights that take part in a matmul: all decoder projections plus lm_head."""
    c = config
    qkv = c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    o = c.num_attention_heads * c.head_dim * c.hidden_size
    mlp = 3 * c.hidden_size * c.intermediate_size  # gate + up + down
    lm_head = c.hidden_size * c.vocab_size
    return c.num_hidden_layers * (qkv + o + mlp) + lm_head


def num_params(config: LlamaConfig) -> int:
    """Total stored parameters (what `model.num_parameters()` reports)."""
    c = config
    norms = (2 * c.num_hidden_layers + 1) * c.hidden_size
    embed = c.vocab_size * c.hidden_size
    lm_head = 0 if c.tie_word_embeddings else c.hidden_size * c.vocab_size
    return matmul_params(config) - c.hidden_size * c.vocab_size + lm_head + embed + norms


def flops_per_token(config: LlamaConfig, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token at sequence length `seq_len`."""
    attention = 12 * config.num_hidden_layers * seq_len * config.head_dim * config.num_attention_heads
    return float(6 * matmul_params(config) + attention)


def stage_costs(config: LlamaConfig) -> tuple[float, float, float]:
    """Pipeline balance: (decoder layer, embedding, output head) costs in parameter units
    (matmul FLOPs per token / 2). The embedding is a lookup: no matmul."""
    c = config
    layer = (matmul_params(c) - c.hidden_size * c.vocab_size) / c.num_hidden_layers
    return float(layer), 0.0, float(c.hidden_size * c.vocab_size)
