"""Hugging Face Llama <-> nanolight weight conversion, driven by ONE table (`WEIGHT_MAP`).

Each row names a nanolight tensor, the HF tensors it is made of, and how they combine:

    copy     same tensor, same name pattern
    qkv      q_proj, k_proj, v_proj -> qkv_proj, grouped per kv head g:
             [q_{g*r} .. q_{g*r+r-1}, k_g, v_g] (r = n_heads / n_kv, head_dim rows each)
    gate_up  gate_proj, up_proj -> gate_up_proj, rows interleaved [gate_0, up_0, gate_1, ...]

Both directions read the same rows, so a new tensor is added in one place. Fusing and
splitting only move rows, which is why HF -> nanolight -> HF is bit-identical.

HF weights are read straight from safetensors (single file or a sharded index), one tensor at a
time, never by instantiating a transformers model: conversion needs one copy of the weights in
memory, not two plus the framework's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from nanolight.checkpoint.atomic import LAST_POINTER, atomic_directory, resolve_checkpoint
from nanolight.checkpoint.files import save_tensors
from nanolight.checkpoint.pretrained import (
    check_state_dict,
    copy_tokenizer_files,
    read_checkpoint,
    write_checkpoint,
)
from nanolight.models.llama_config import HF_PASSTHROUGH_KEYS, LlamaConfig, read_hf_config

__all__ = [
    "WEIGHT_MAP",
    "convert_hf_to_nanolight",
    "convert_nanolight_to_hf",
    "hf_to_nanolight_state_dict",
    "nanolight_to_hf_state_dict",
    "resolve_checkpoint_path",
]


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
    return torch.stack((gate, up), dim=1).reshape(-1, gate.size(1))  # (2*intermediate, C), interleaved


def split_gate_up(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = gate_up.view(-1, 2, gate_up.size(1))  # (intermediate, 2, C)
    return pairs[:, 0].contiguous(), pairs[:, 1].contiguous()


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
    """
    if config.tie_word_embeddings:
        sd = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    check_state_dict(config, sd)
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


# ---------------------------------------------------------------------- reading HF files
class HFSafetensors:
    """Lazy access to the tensors of a HF model directory (single file or sharded index)."""

    def __init__(self, directory: Path) -> None:
        index = directory / "model.safetensors.index.json"
        single = directory / "model.safetensors"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: directory / file for name, file in weight_map.items()}
        elif single.is_file():
            with safe_open(str(single), framework="pt") as f:
                self.files = {name: single for name in f.keys()}  # noqa: SIM118
        else:
            raise FileNotFoundError(
                f"no model.safetensors or model.safetensors.index.json in {directory}; only safetensors "
                "checkpoints are read (re-save a .bin checkpoint with safe_serialization=True)"
            )

    def keys(self) -> set[str]:
        return set(self.files)

    def get(self, name: str) -> torch.Tensor:
        with safe_open(str(self.files[name]), framework="pt") as f:
            return f.get_tensor(name)


def resolve_checkpoint_path(path_or_id: str | Path) -> Path:
    """A local directory as is; otherwise a Hub id resolved with `snapshot_download`."""
    path = Path(path_or_id)
    if path.exists():
        if not path.is_dir():
            raise FileNotFoundError(f"checkpoint path {path} is a file; pass the model directory")
        return path
    s = str(path_or_id)
    if re.fullmatch(r"[\w.-]+/[\w.-]+", s) and not s.startswith((".", "/")):
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(s, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
        except Exception as e:  # offline, typo, gated repo: report both readings of the argument
            raise FileNotFoundError(
                f"{s} is neither a local directory nor a downloadable Hub model id ({e})"
            ) from e
    raise FileNotFoundError(f"checkpoint path {path} does not exist")


# ---------------------------------------------------------------------- whole-directory conversion
def convert_hf_to_nanolight(
    checkpoint_path: str | Path, save_path: str | Path, overwrite: bool = False
) -> Path:
    """HF Llama directory (or Hub id) -> nanolight checkpoint directory, written atomically."""
    src = resolve_checkpoint_path(checkpoint_path)
    _check_distinct(src, save_path)
    hf_config = read_hf_config(src)
    config = LlamaConfig.from_hf(hf_config)
    weights = HFSafetensors(src)
    sd = hf_to_nanolight_state_dict(config, weights.get, weights.keys())
    hf_extra = {k: hf_config[k] for k in HF_PASSTHROUGH_KEYS if k in hf_config}
    with atomic_directory(save_path, overwrite=overwrite) as tmp:
        write_checkpoint(tmp, config, sd, hf_extra)
        copy_tokenizer_files(src, tmp)
    return Path(save_path)


def convert_nanolight_to_hf(
    checkpoint_path: str | Path, save_path: str | Path, overwrite: bool = False
) -> Path:
    """nanolight checkpoint directory -> HF LlamaForCausalLM directory, written atomically: the
    weights, config.json, generation_config.json and the tokenizer the checkpoint carries, so
    ``AutoTokenizer`` and ``pipeline("text-generation")`` load the export as is.

    The source may be a sharded training step directory from any topology (`read_checkpoint`),
    or a run's ``last`` pointer (or the ``checkpoints`` directory holding it)."""
    src = Path(checkpoint_path)
    if src.name == LAST_POINTER or (src / LAST_POINTER).is_file():
        src = resolve_checkpoint(src) or src  # the step directory `last` names
    if not src.is_dir():
        raise FileNotFoundError(f"checkpoint path {src} does not exist or is not a directory")
    _check_distinct(src, save_path)
    config, sd, hf_extra = read_checkpoint(src)
    hf_sd = nanolight_to_hf_state_dict(config, sd)
    dtype = next(iter(sd.values())).dtype
    hf_config = {**config.to_hf_dict(), **hf_extra, "dtype": str(dtype).removeprefix("torch.")}
    with atomic_directory(save_path, overwrite=overwrite) as tmp:
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        save_tensors(tmp / "model.safetensors", hf_sd)
        copy_tokenizer_files(src, tmp)
        if not (tmp / "generation_config.json").exists():  # what `generate` / `pipeline` start from
            generation = {k: v for k, v in hf_extra.items() if k in HF_PASSTHROUGH_KEYS}
            (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return Path(save_path)


def _check_distinct(src: Path, save_path: str | Path) -> None:
    if Path(save_path).absolute().resolve() == src.absolute().resolve():
        raise ValueError(f"save path {save_path} is the checkpoint being converted; choose another directory")
