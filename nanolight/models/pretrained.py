"""The Llama's model directories: saved, loaded, and converted to and from Hugging Face.

The model owns its pretrained loading: what a directory's ``config.json`` fields mean (a
`LlamaConfig`), which tensors it must hold, and the Llama <-> HF mapping (`hf_adapter.py`). The
files themselves are read and written by `checkpoint/pretrained.py`, which knows no model. HF
weights are read straight from safetensors (single file or a sharded index), one tensor at a time,
never by instantiating a transformers model: conversion needs one copy of the weights in memory,
not two plus the framework's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from nanolight.checkpoint.atomic import atomic_directory, resolve_checkpoint, save_tensors
from nanolight.checkpoint.load import check_matches
from nanolight.checkpoint.pretrained import (
    check_distinct,
    read_model_directory,
    resolve_checkpoint_path,
    run_extras,
    write_model_directory,
)
from nanolight.checkpoint.reader import HF_INDEX, WEIGHTS_FILE, CheckpointReader
from nanolight.models.hf_adapter import (
    config_from_hf,
    config_to_hf,
    generation_config,
    hf_to_nanolight_state_dict,
    nanolight_to_hf_state_dict,
)
from nanolight.models.llama import LlamaForCausalLM
from nanolight.models.llama_config import LlamaConfig, read_hf_config


def read_checkpoint(path: str | Path) -> tuple[LlamaConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """A nanolight checkpoint directory (any `checkpoint.pretrained.read_model_directory` reads:
    a model directory, a step directory of any layout, a run's ``last``) -> (config, state_dict,
    hf_extra); the state dict holds no tied ``lm_head.weight``."""
    meta, state_dict, hf_extra = read_model_directory(path)
    config = LlamaConfig.from_dict(meta)
    if config.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)  # an alias of the embedding, stored once
    return config, state_dict, hf_extra


def model_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The tensors to store: every parameter once (a tied lm_head is not stored)."""
    sd = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def check_state_dict(config: LlamaConfig, state_dict: dict[str, torch.Tensor]) -> None:
    """Compare names and shapes with a model of `config`; name every offending tensor."""
    with torch.device("meta"):
        # built with sdpa: flash-attn's availability is irrelevant to names and shapes
        buildable = LlamaConfig.from_dict({**config.to_dict(), "attn_implementation": "sdpa"})
        expected = model_state_dict(LlamaForCausalLM(buildable))
    check_matches(
        {k: tuple(t.shape) for k, t in expected.items()}, {k: tuple(t.shape) for k, t in state_dict.items()}
    )


def save_pretrained(
    model: LlamaForCausalLM,
    path: str | Path,
    tokenizer_dir: str | Path | None = None,
    overwrite: bool = False,
    hf_extra: dict[str, Any] | None = None,
) -> Path:
    """Save a (single-device, unsharded) model as a nanolight checkpoint directory, atomically."""
    fields = model.config.directory_fields()
    return write_model_directory(path, fields, model_state_dict(model), hf_extra, tokenizer_dir, overwrite)


def load_pretrained(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    attn_implementation: str | None = None,
) -> LlamaForCausalLM:
    """Load a nanolight checkpoint (any path `read_checkpoint` takes, `last` included) ->
    `LlamaForCausalLM` in eval mode; `model(input_ids)` -> logits.

    `dtype=None` keeps the stored dtype. `attn_implementation` overrides the saved one (e.g.
    "flash_attention_2" on a GPU).
    """
    config, state_dict, _ = read_checkpoint(path)
    if attn_implementation is not None:
        config.attn_implementation = attn_implementation
    check_state_dict(config, state_dict)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    if config.tie_word_embeddings:
        state_dict["lm_head.weight"] = state_dict["model.embed_tokens.weight"]
    model.load_state_dict(state_dict, strict=True, assign=True)
    model.tie_weights()
    model.to(device=device, dtype=dtype)
    return model.eval()


def convert_hf_to_nanolight(
    checkpoint_path: str | Path, save_path: str | Path, overwrite: bool = False
) -> Path:
    """HF Llama directory (or Hub id) -> nanolight checkpoint directory, written atomically."""
    src = resolve_checkpoint_path(checkpoint_path)
    check_distinct(src, save_path)
    config, hf_extra = config_from_hf(read_hf_config(src))
    if not ((src / WEIGHTS_FILE).is_file() or (src / HF_INDEX).is_file()):
        raise FileNotFoundError(
            f"no {WEIGHTS_FILE} or {HF_INDEX} in {src}; only safetensors checkpoints are read "
            "(re-save a .bin checkpoint with safe_serialization=True)"
        )
    weights = CheckpointReader.open(src)  # one tensor at a time, from the memory-mapped files
    names = {name.removeprefix("model/") for name in weights.names("model/")}
    sd = hf_to_nanolight_state_dict(config, lambda name: weights.read(f"model/{name}"), names)
    return write_model_directory(save_path, config.directory_fields(), sd, hf_extra, src, overwrite)


def convert_nanolight_to_hf(
    checkpoint_path: str | Path, save_path: str | Path, overwrite: bool = False
) -> Path:
    """nanolight checkpoint directory -> HF LlamaForCausalLM directory, written atomically: the
    weights, config.json, generation_config.json and the tokenizer the checkpoint carries, so
    ``AutoTokenizer`` and ``pipeline("text-generation")`` load the export as is.

    The source may be a sharded training step directory from any topology (`read_checkpoint`),
    or a run's ``last`` pointer (or the ``checkpoints`` directory holding it)."""
    src = resolve_checkpoint(checkpoint_path) or Path(checkpoint_path)  # `last` -> its step directory
    if not src.is_dir():
        raise FileNotFoundError(f"checkpoint path {src} does not exist or is not a directory")
    check_distinct(src, save_path)
    config, sd, hf_extra = read_checkpoint(src)
    check_state_dict(config, sd)
    hf_sd = nanolight_to_hf_state_dict(config, sd)
    hf_config = config_to_hf(config, hf_extra, next(iter(sd.values())).dtype)
    with atomic_directory(save_path, overwrite=overwrite) as tmp:
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        save_tensors(tmp / "model.safetensors", hf_sd)
        run_extras(src).copy_into(tmp)
        if not (tmp / "generation_config.json").exists():  # what `generate` / `pipeline` start from
            (tmp / "generation_config.json").write_text(
                json.dumps(generation_config(hf_extra), indent=2) + "\n"
            )
    return Path(save_path)
