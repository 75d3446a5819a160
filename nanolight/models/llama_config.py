"""`LlamaConfig`: the shape of a Llama/SmolLM model, validated, and its Hugging Face mapping; the
named shapes (`PRESETS`: SmolLM's, and Llama 3 8B's for planning); the arithmetic of a shape (parameters, FLOPs per token, pipeline
stage costs).

One flat dataclass, so that a Hydra group file (`conf/model/*.yaml`) is just its fields and a
nanolight checkpoint's `config.json` is `asdict(config)` plus a format tag. Every check raises
a `ValueError` that says what to change, because a wrong shape found at step 0 of a multi-node
job costs far more than one found when the config is built.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from nanolight.errors import UsageError

ATTN_IMPLEMENTATIONS = ("sdpa", "flash_attention_2", "eager")
SUPPORTED_HF_ARCHITECTURES = ("LlamaForCausalLM",)
SUPPORTED_HF_MODEL_TYPES = ("llama",)
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# HF config keys nanolight does not model but carries through a conversion unchanged.
HF_PASSTHROUGH_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


# a model directory's name for rope_scaling (`LlamaConfig.directory_fields` says why)
DIRECTORY_ROPE_KEY = "nanolight_rope_scaling"


@dataclass
class LlamaConfig:
    """Hyper-parameters of `LlamaForCausalLM`; field names follow HF's `LlamaConfig`.

    `head_dim=None` means `hidden_size // num_attention_heads` and is resolved at construction.
    `rope_scaling` is None (plain RoPE) or a llama3 dict: {"rope_type": "llama3", "factor",
    "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}.
    """

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attn_implementation: str = "sdpa"
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and self.num_attention_heads and self.hidden_size:
            if self.hidden_size % self.num_attention_heads != 0:
                raise UsageError(
                    f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                    f"{self.num_attention_heads}; pick a head count that divides it or set head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if isinstance(self.rope_scaling, Mapping):  # a Hydra DictConfig becomes a plain dict
            self.rope_scaling = {str(k): v for k, v in self.rope_scaling.items()}
        self.rope_theta = float(self.rope_theta)
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ValueError with a fix-it message if the config cannot build a model."""
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
            _require_positive_int(name, getattr(self, name))
        for name in ("num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            _require_positive_int(name, getattr(self, name))
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise UsageError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (grouped-query attention shares each "
                "kv head between a whole number of query heads); change one of them"
            )
        if self.head_dim % 2 != 0:
            raise UsageError(
                f"head_dim={self.head_dim} must be even for rotary embeddings; use an even head_dim"
            )
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise UsageError(
                f"attn_implementation={self.attn_implementation!r} is not supported; "
                f"choose one of {', '.join(ATTN_IMPLEMENTATIONS)}"
            )
        for name in ("rope_theta", "rms_norm_eps", "initializer_range"):
            if not getattr(self, name) > 0:
                raise UsageError(f"{name}={getattr(self, name)} must be > 0")
        if not isinstance(self.tie_word_embeddings, bool):
            raise UsageError(f"tie_word_embeddings must be true or false, got {self.tie_word_embeddings!r}")
        _validate_rope_scaling(self.rope_scaling)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> LlamaConfig:
        """A named shape (`PRESETS`), optionally with overrides."""
        if name not in PRESETS:
            raise UsageError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], strict: bool = False) -> LlamaConfig:
        """Build from a dict. Extra keys (e.g. a nanolight `config.json`'s format tag) are
        dropped, or with `strict=True` (a Hydra `model:` group) rejected, naming the valid keys."""
        names = [f.name for f in fields(cls)]
        if DIRECTORY_ROPE_KEY in d:  # a model directory's (`directory_fields`)
            d = {
                **{k: v for k, v in d.items() if k != DIRECTORY_ROPE_KEY},
                "rope_scaling": d[DIRECTORY_ROPE_KEY],
            }
        unknown = sorted(set(d) - set(names))
        if strict and unknown:
            raise UsageError(f"unknown model config key(s) {unknown}; valid keys: {', '.join(names)}")
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_hf(cls, config: Mapping[str, Any] | str | Path, **overrides: Any) -> LlamaConfig:
        """Build from a Hugging Face Llama `config.json` (a dict, the file, or its directory).

        Reads both the transformers 4.x keys (`rope_theta`, `rope_scaling`) and the 5.x
        `rope_parameters` dict. Rejects what nanolight cannot run rather than ignoring it.
        """
        d = read_hf_config(config) if isinstance(config, str | Path) else dict(config)
        check_hf_architecture(d)
        for key in ("attention_bias", "mlp_bias"):
            if d.get(key):
                raise UsageError(
                    f"HF config sets {key}=true; nanolight's Llama has no biases (set it to false)"
                )
        if d.get("hidden_act", "silu") != "silu":
            raise UsageError(
                f"HF config has hidden_act={d['hidden_act']!r}; only 'silu' (SwiGLU) is supported"
            )
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise UsageError(
                "HF config sets partial_rotary_factor != 1; nanolight rotates the whole head_dim"
            )
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "default":
            scaling = None
        elif rope_type == "llama3":
            scaling = {"rope_type": "llama3", **{k: rope.get(k) for k in LLAMA3_ROPE_KEYS}}
        else:
            raise UsageError(
                f"HF config uses rope_scaling type {rope_type!r}; nanolight supports 'default' and 'llama3'"
            )
        kwargs = dict(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads"),
            head_dim=d.get("head_dim"),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            initializer_range=d.get("initializer_range", 0.02),
        )
        return cls(**{**kwargs, **overrides})

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def directory_fields(self) -> dict[str, Any]:
        """What a nanolight model directory's ``config.json`` holds of this config (save_pretrained,
        HF import, training step directories): every field, a llama3 rope_scaling kept whole under
        `DIRECTORY_ROPE_KEY` (omitted when null), so that it round-trips. Not under its own name:
        AutoTokenizer reads the directory's config.json too, as a bare transformers config when it
        is not HF's Llama, and transformers 5 fails on such a config's ``rope_scaling``
        (AttributeError: no max_position_embeddings yet). `from_dict` reads both keys."""
        fields = self.to_dict()
        scaling = fields.pop("rope_scaling")
        if scaling is not None:
            fields[DIRECTORY_ROPE_KEY] = scaling
        return fields

    def to_hf_dict(self) -> dict[str, Any]:
        """A `config.json` for transformers' LlamaForCausalLM (readable by 4.x and 5.x)."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            # 5.x reads rope_parameters; 4.x reads rope_theta + rope_scaling (absent = plain RoPE).
            "rope_theta": self.rope_theta,
            "rope_parameters": {
                "rope_type": "default",
                **(self.rope_scaling or {}),
                "rope_theta": self.rope_theta,
            },
            **({"rope_scaling": dict(self.rope_scaling)} if self.rope_scaling else {}),
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "attention_dropout": 0.0,
        }


# ---------------------------------------------------------------------- helpers
def read_hf_config(path: str | Path) -> dict[str, Any]:
    """Load a HF `config.json` given the file or the directory that holds it."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no config.json found at {path}; point at a Hugging Face model directory")
    return json.loads(file.read_text())


def check_hf_architecture(d: Mapping[str, Any]) -> None:
    """Refuse configs of other architectures, naming the ones nanolight converts."""
    archs = d.get("architectures") or []
    model_type = d.get("model_type")
    arch_ok = not archs or any(a in SUPPORTED_HF_ARCHITECTURES for a in archs)
    type_ok = model_type in SUPPORTED_HF_MODEL_TYPES or (model_type is None and bool(archs))
    if not (arch_ok and type_ok):
        raise UsageError(
            f"unsupported architecture {archs or None} (model_type={model_type!r}); nanolight converts "
            f"{', '.join(SUPPORTED_HF_ARCHITECTURES)} (model_type "
            f"{', '.join(repr(t) for t in SUPPORTED_HF_MODEL_TYPES)}) only"
        )


def _require_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UsageError(f"{name} must be a positive integer, got {value!r}")


def _validate_rope_scaling(rope_scaling: dict | None) -> None:
    if rope_scaling is None:
        return
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if rope_type != "llama3":
        raise UsageError(
            f"rope_scaling type {rope_type!r} is not supported; use null (plain RoPE) or "
            "{'rope_type': 'llama3', ...}"
        )
    missing = [k for k in LLAMA3_ROPE_KEYS if rope_scaling.get(k) is None]
    if missing:
        raise UsageError(f"llama3 rope_scaling is missing {', '.join(missing)}; add them to rope_scaling")
    if rope_scaling["high_freq_factor"] <= rope_scaling["low_freq_factor"]:
        raise UsageError("llama3 rope_scaling needs high_freq_factor > low_freq_factor")


# Named shapes, as plain keyword dicts for `LlamaConfig`.
#
# The three released sizes follow the SmolLM (v1) `config.json` files on the Hugging Face Hub
# (HuggingFaceTB/SmolLM-135M, -360M, -1.7B): rope_theta 10000, 2048 positions, tied embeddings,
# the 49152-token cosmo2 tokenizer. `smollm-tiny` is ours: the same family shrunk to run on a CPU
# in tests and smoke runs. `llama3-8b` is Meta-Llama-3-8B's shape (its `config.json`: GQA with 8 KV
# heads, the 128256-token tokenizer, rope_theta 500000, 8192 positions, untied head): a size people
# train, for the planner and the dry run to be held to each other at (issue 37); on one host it does
# not train (its weights, gradients and AdamW moments are 128 GB in fp32).
# `conf/model/<name>.yaml` mirrors each entry (a test checks they agree).
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
    "llama3-8b": {  # every field spelled out: nothing inherited from the SmolLM family's
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "attn_implementation": "sdpa",
        "initializer_range": 0.02,
        "head_dim": None,
    },
}


# Training FLOPs per token of a Llama model, for throughput and MFU.
#
#     flops_per_token = 6 * N_matmul + 12 * L * seq_len * head_dim * n_heads
#
# N_matmul counts every weight that takes part in a matmul: per layer the fused qkv, o, fused
# gate_up and down projections, plus the lm_head (hidden x vocab) even when it is tied to the
# embedding, because the output matmul is done either way. The embedding lookup and the norm
# weights do no matmul and are left out. The factor 6 is 2 (multiply + add) x 3 (forward, and
# backward w.r.t. activations and w.r.t. weights).
#
# The attention term is the QK^T and AV score matmuls, which have no weights: per layer and
# token 2 matmuls x 2 FLOPs x seq_len x (n_heads * head_dim) forward, x3 for training = 12.
# This is the formula of PaLM (Chowdhery et al. 2022, appendix B) and of Chinchilla
# (Hoffmann et al. 2022, appendix F, up to its softmax/embedding extras), as nanoGPT's
# `estimate_mfu` uses it. No causal halving is applied: the masked upper triangle is counted
# as computed, like nanoGPT and PaLM, so MFU figures stay comparable with theirs.


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


def attention_flops_per_token(config: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs of one layer's score matmuls per token (the attention term above, one layer)."""
    return float(12 * seq_len * config.head_dim * config.num_attention_heads)


def flops_per_token(config: LlamaConfig, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token at sequence length `seq_len`."""
    return float(
        6 * matmul_params(config) + config.num_hidden_layers * attention_flops_per_token(config, seq_len)
    )


def stage_costs(config: LlamaConfig) -> tuple[float, float, float]:
    """Pipeline balance: (decoder layer, embedding, output head) costs in parameter units
    (matmul FLOPs per token / 2). The embedding is a lookup: no matmul."""
    c = config
    layer = (matmul_params(c) - c.hidden_size * c.vocab_size) / c.num_hidden_layers
    return float(layer), 0.0, float(c.hidden_size * c.vocab_size)
