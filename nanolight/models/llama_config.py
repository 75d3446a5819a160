"""`LlamaConfig`: the shape of a Llama/SmolLM model, validated, and its Hugging Face mapping.

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
        """A named SmolLM shape (see `nanolight.models.presets`), optionally with overrides."""
        from nanolight.models.presets import PRESETS

        if name not in PRESETS:
            raise UsageError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], strict: bool = False) -> LlamaConfig:
        """Build from a dict. Extra keys (e.g. a nanolight `config.json`'s format tag) are
        dropped, or with `strict=True` (a Hydra `model:` group) rejected, naming the valid keys."""
        names = [f.name for f in fields(cls)]
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
