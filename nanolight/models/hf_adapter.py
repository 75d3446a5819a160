"""The Llama <-> Hugging Face mapping, owned by the model (as torchtitan's per-model
``state_dict_adapter.py``): tensor names, shapes and fused layouts, and the config's way there and
back. `models/pretrained.py` loads and converts the directories; this file knows only Llama.

The weights are driven by ONE table (`WEIGHT_MAP`). Each row names a nanolight tensor, the HF
tensors it is made of, and how they combine:

    copy     same tensor, same name pattern
    qkv      q_proj, k_proj, v_proj -> qkv_proj, grouped per kv head g:
             [q_{g*r} .. q_{g*r+r-1}, k_g, v_g] (r = n_heads / n_kv, head_dim rows each)
    gate_up  gate_proj, up_proj -> gate_up_proj, rows blocked [gate | up]

Both directions read the same rows, so a new tensor is added in one place. Fusing and
splitting only move rows, which is why HF -> nanolight -> HF is bit-identical.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from nanolight.models.llama_config import HF_PASSTHROUGH_KEYS, LlamaConfig

__all__ = [
    "WEIGHT_MAP",
    "config_from_hf",
    "config_to_hf",
    "hf_to_nanolight_state_dict",
    "nanolight_to_hf_state_dict",
]


def config_from_hf(hf_config: Mapping[str, Any]) -> tuple[LlamaConfig, dict[str, Any]]:
    """A HF ``config.json`` -> (the model's config, the HF-only keys a nanolight directory carries
    unchanged so the way back restores them: bos/eos/pad token ids)."""
    extra = {k: hf_config[k] for k in HF_PASSTHROUGH_KEYS if k in hf_config}
    return LlamaConfig.from_hf(hf_config), extra


def config_to_hf(config: LlamaConfig, extra: Mapping[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """The HF ``config.json`` of a model of `config` whose weights are `dtype`."""
    return {**config.to_hf_dict(), **extra, "dtype": str(dtype).removeprefix("torch.")}


def generation_config(extra: Mapping[str, Any]) -> dict[str, Any]:
    """What ``generate`` / ``pipeline`` start from when the directory brings no generation_config.json."""
    return {k: v for k, v in extra.items() if k in HF_PASSTHROUGH_KEYS}


@dataclass(frozen=True)
class WeightRule:
    nanolight: str  # name template; "{i}" is the layer index
    hf: tuple[str, ...]  # HF name templates, in the order `kind` combines them
    kind: str  # "copy" | "qkv" | "gate_up"
    untied_only: bool = False  # skipped when embeddings are tied (lm_head shares the embedding)


_L = "model.layers.{i}."
WEIGHT_MAP: tuple[WeightRule, ...] = (
    WeightRule("model.embed_tokens.weight", ("model.embed_tokens.weight",), "copy"),
    WeightRule(_L + "input_layernorm.weight", (_L + "input_layernorm.weight",), "copy"),
    WeightRule(
        _L + "self_attn.qkv_proj.weight",
        (_L + "self_attn.q_proj.weight", _L + "self_attn.k_proj.weight", _L + "self_attn.v_proj.weight"),
        "qkv",
    ),
    WeightRule(_L + "self_attn.o_proj.weight", (_L + "self_attn.o_proj.weight",), "copy"),
    WeightRule(_L + "post_attention_layernorm.weight", (_L + "post_attention_layernorm.weight",), "copy"),
    WeightRule(
        _L + "mlp.gate_up_proj.weight", (_L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight"), "gate_up"
    ),
    WeightRule(_L + "mlp.down_proj.weight", (_L + "mlp.down_proj.weight",), "copy"),
    WeightRule("model.norm.weight", ("model.norm.weight",), "copy"),
    WeightRule("lm_head.weight", ("lm_head.weight",), "copy", untied_only=True),
)
# HF tensors that carry no weights (old checkpoints stored RoPE tables); skipped on import.
_IGNORED_HF = re.compile(r".*rotary_emb\.inv_freq$")


def expand_weight_map(config: LlamaConfig) -> list[tuple[str, tuple[str, ...], str]]:
    """WEIGHT_MAP with layer indices filled in: [(nanolight_name, hf_names, kind), ...]."""
    rows = []
    for rule in WEIGHT_MAP:
        if rule.untied_only and config.tie_word_embeddings:
            continue
        layers = range(config.num_hidden_layers) if "{i}" in rule.nanolight else [None]
        for i in layers:
            rows.append((rule.nanolight.format(i=i), tuple(h.format(i=i) for h in rule.hf), rule.kind))
    return rows


def hf_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Expected shape of every HF tensor for `config`."""
    c = config
    C, hd = c.hidden_size, c.head_dim
    by_suffix = {
        "embed_tokens.weight": (c.vocab_size, C),
        "lm_head.weight": (c.vocab_size, C),
        "norm.weight": (C,),  # input_layernorm, post_attention_layernorm and the final norm
        "q_proj.weight": (c.num_attention_heads * hd, C),
        "k_proj.weight": (c.num_key_value_heads * hd, C),
        "v_proj.weight": (c.num_key_value_heads * hd, C),
        "o_proj.weight": (C, c.num_attention_heads * hd),
        "gate_proj.weight": (c.intermediate_size, C),
        "up_proj.weight": (c.intermediate_size, C),
        "down_proj.weight": (C, c.intermediate_size),
    }
    shapes = {}
    for _, hf_names, _ in expand_weight_map(config):
        for name in hf_names:
            shapes[name] = next(s for suffix, s in by_suffix.items() if name.endswith(suffix))
    return shapes


# ---------------------------------------------------------------------- fused layouts
def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: LlamaConfig) -> torch.Tensor:
    n_kv, hd = config.num_key_value_heads, config.head_dim
    r = config.num_attention_heads // n_kv
    C = q.size(1)
    groups = (q.view(n_kv, r, hd, C), k.view(n_kv, 1, hd, C), v.view(n_kv, 1, hd, C))
    return torch.cat(groups, dim=1).reshape(n_kv * (r + 2) * hd, C)  # (n_kv*(r+2)*head_dim, C)


def split_qkv(qkv: torch.Tensor, config: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n_kv, hd = config.num_key_value_heads, config.head_dim
    r = config.num_attention_heads // n_kv
    C = qkv.size(1)
    grouped = qkv.view(n_kv, r + 2, hd, C)
    q = grouped[:, :r].reshape(n_kv * r * hd, C)
    return q.contiguous(), grouped[:, r].contiguous().view(-1, C), grouped[:, r + 1].contiguous().view(-1, C)


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.cat((gate, up), dim=0)  # (2*intermediate, C): [gate | up]


def split_gate_up(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = gate_up.chunk(2, dim=0)
    return gate.contiguous(), up.contiguous()


# ---------------------------------------------------------------------- state-dict conversion
def hf_to_nanolight_state_dict(
    config: LlamaConfig, get: Callable[[str], torch.Tensor], available: set[str]
) -> dict[str, torch.Tensor]:
    """Build nanolight tensors from HF ones (`get(name)` loads one HF tensor on demand)."""
    shapes = hf_shapes(config)
    missing = sorted(set(shapes) - available)
    if missing:
        raise ValueError(f"HF checkpoint lacks {len(missing)} tensor(s) the config needs: {missing[:5]}")
    extra = sorted(n for n in available - set(shapes) if not _IGNORED_HF.match(n))
    if config.tie_word_embeddings and "lm_head.weight" in extra:
        extra.remove("lm_head.weight")  # some exporters store the tied head anyway; it is the embedding
    if extra:
        raise ValueError(f"HF checkpoint has tensor(s) a Llama model does not use: {extra[:5]}")

    def load(name: str) -> torch.Tensor:
        t = get(name)
        if tuple(t.shape) != shapes[name]:
            raise ValueError(
                f"tensor {name} has shape {tuple(t.shape)} but the config implies {shapes[name]}"
            )
        return t

    out = {}
    for nl_name, hf_names, kind in expand_weight_map(config):
        parts = [load(n) for n in hf_names]
        out[nl_name] = _combine(kind, parts, config)
    return out


def nanolight_to_hf_state_dict(config: LlamaConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Split nanolight tensors into HF ones (the inverse of `hf_to_nanolight_state_dict`).

    Accepts `model.state_dict()` directly: with tied embeddings its lm_head entry is dropped.
    The names and shapes are the caller's to check (`models/pretrained.py` does, naming them).
    """
    if config.tie_word_embeddings:
        sd = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    out = {}
    for nl_name, hf_names, kind in expand_weight_map(config):
        out.update(zip(hf_names, _split(kind, sd[nl_name], config), strict=True))
    return out


def _combine(kind: str, parts: list[torch.Tensor], config: LlamaConfig) -> torch.Tensor:
    if kind == "qkv":
        return fuse_qkv(*parts, config)
    if kind == "gate_up":
        return fuse_gate_up(*parts)
    return parts[0]


def _split(kind: str, t: torch.Tensor, config: LlamaConfig) -> tuple[torch.Tensor, ...]:
    if kind == "qkv":
        return split_qkv(t, config)
    if kind == "gate_up":
        return split_gate_up(t)
    return (t,)
