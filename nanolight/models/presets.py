"""Named SmolLM shapes, as plain keyword dicts for `LlamaConfig`.

The three released sizes follow the SmolLM (v1) `config.json` files on the Hugging Face Hub
(HuggingFaceTB/SmolLM-135M, -360M, -1.7B): rope_theta 10000, 2048 positions, tied embeddings,
the 49152-token cosmo2 tokenizer. `smollm-tiny` is ours: the same family shrunk to run on a CPU
in tests and smoke runs. `conf/model/<name>.yaml` mirrors each entry (a test checks they agree).
"""

from __future__ import annotations

_SMOLLM_COMMON = dict(
    vocab_size=49152,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    rope_scaling=None,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    attn_implementation="sdpa",
    initializer_range=0.02,
    head_dim=None,
)

PRESETS: dict[str, dict] = {
    "smollm-tiny": {
        **_SMOLLM_COMMON,
        "vocab_size": 8192,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
    },
    "smollm-135m": {
        **_SMOLLM_COMMON,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
    },
    "smollm-360m": {
        **_SMOLLM_COMMON,
        "hidden_size": 960,
        "intermediate_size": 2560,
        "num_hidden_layers": 32,
        "num_attention_heads": 15,
        "num_key_value_heads": 5,
    },
    "smollm-1.7b": {
        **_SMOLLM_COMMON,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 24,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
    },
}
