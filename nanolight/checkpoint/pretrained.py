"""Model directories: a whole model saved and loaded, and converted to and from Hugging Face.

The one file of `checkpoint/` that builds a model (`load_pretrained` returns a `LlamaForCausalLM`);
the Llama <-> HF tensor mapping is the model's own (`models/hf_adapter.py`). A model directory is
``config.json`` (`save.write_config`: the LlamaConfig fields, rope_scaling omitted when null; the
format's tags; ``"hf_extra"``, the HF-only keys such as bos/eos/pad token ids, carried through
HF -> nanolight -> HF unchanged), one ``model.safetensors`` of full tensors under nanolight names
(a tied lm_head is not stored), and the tokenizer files, copied verbatim so
``AutoTokenizer.from_pretrained(dir)`` works. Its ``"sharding"`` is null; a training step
directory is a model directory too, with ``{"index": "index.json", "prefix": "model."}`` (the
module's shards, the model's tensors under that prefix).

Directories are written atomically (`atomic.py`). HF weights are read straight from safetensors
(single file or a sharded index), one tensor at a time, never by instantiating a transformers
model: conversion needs one copy of the weights in memory, not two plus the framework's.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import torch

from nanolight.checkpoint.atomic import (
    MissingCheckpointFile,
    atomic_directory,
    load_json,
    resolve_checkpoint,
    save_tensors,
)
from nanolight.checkpoint.index import INDEX_FILE
from nanolight.checkpoint.load import check_matches
from nanolight.checkpoint.reader import CONFIG_FILE, HF_INDEX, TRAINER_FILE, WEIGHTS_FILE, CheckpointReader
from nanolight.checkpoint.save import FORMAT_NAME, FORMAT_VERSION, ExportExtras, write_config
from nanolight.models.hf_adapter import (
    config_from_hf,
    config_to_hf,
    generation_config,
    hf_to_nanolight_state_dict,
    nanolight_to_hf_state_dict,
)
from nanolight.models.llama import LlamaForCausalLM
from nanolight.models.llama_config import LlamaConfig, read_hf_config

# Files a tokenizer (and HF generation defaults) may consist of; copied when present.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def run_extras(tokenizer_dir: str | Path | None, hf_extra: dict[str, Any] | None = None) -> ExportExtras:
    """What a run adds to its checkpoints' exports: the tokenizer files it saved to
    `tokenizer_dir`, and the tokenizer's HF token ids (the recipe hands these to its strategy)."""
    directory = Path(tokenizer_dir) if tokenizer_dir else None
    return ExportExtras(directory, TOKENIZER_FILES, {"hf_extra": dict(hf_extra or {})})


def carried_extras(directory: str | Path, extras: ExportExtras | None) -> ExportExtras:
    """A run started from model directory `directory` keeps its HF token ids for the way back
    (those `extras` give otherwise)."""
    extras = extras or ExportExtras()
    cfg_file = Path(directory) / CONFIG_FILE
    hf_extra = load_json(cfg_file, "model config").get("hf_extra") if cfg_file.is_file() else None
    if not hf_extra:
        return extras
    return dataclasses.replace(extras, config={**extras.config, "hf_extra": hf_extra})


# ---------------------------------------------------------------------- raw read / write
def write_model_directory(
    path: str | Path,
    config: LlamaConfig,
    state_dict: dict[str, torch.Tensor],
    hf_extra: dict[str, Any] | None,
    tokenizer_dir: str | Path | None,
    overwrite: bool,
) -> Path:
    """config.json, model.safetensors and the tokenizer files found in `tokenizer_dir`, atomically."""
    with atomic_directory(path, overwrite=overwrite) as tmp:
        write_config(tmp, config.directory_fields(), None, {"hf_extra": hf_extra or {}})
        save_tensors(tmp / WEIGHTS_FILE, state_dict)
        run_extras(tokenizer_dir).copy_into(tmp)
    return Path(path)


def read_checkpoint(path: str | Path) -> tuple[LlamaConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """Read a nanolight checkpoint directory -> (config, state_dict, hf_extra).

    A model directory (one `model.safetensors`) or a training step directory saved at any
    layout, whose config.json says `"sharding": {"index": "index.json", "prefix": "model."}`
    (the weights are reassembled from the shards, `reader.py`). Only the tensors under `prefix` (the module attribute holding the causal
    LM) are kept and the prefix is removed. Either way the state dict has nanolight parameter names,
    full tensors, and no tied `lm_head.weight`. `path` may also name a run's newest step as the
    converter and ``checkpoint.resume`` do: its ``last`` pointer, ``checkpoints/`` or the run's root.
    """
    path = resolve_checkpoint(path) or Path(path)
    cfg_file = path / CONFIG_FILE
    if not cfg_file.is_file():
        hint = ""
        if (path / INDEX_FILE).is_file():
            hint = (
                " (a sharded training checkpoint without config.json: its model is not a nanolight "
                "Llama; read its tensors with nanolight.checkpoint.CheckpointReader)"
            )
        elif (path / WEIGHTS_FILE).is_file() and (path / TRAINER_FILE).is_file():
            hint = (
                " (a training checkpoint whose module holds no nanolight LlamaForCausalLM, so no model "
                "config was written: save the model with nanolight.save_pretrained instead)"
            )
        raise MissingCheckpointFile(f"no nanolight checkpoint at {path}: {CONFIG_FILE} is missing{hint}")
    meta = load_json(cfg_file, "model config")
    if meta.get("format") != FORMAT_NAME:
        hint = " (it looks like a Hugging Face model: convert it with scripts/convert_hf_to_nanolight.py)"
        raise ValueError(
            f"{cfg_file} is not a nanolight checkpoint (format={meta.get('format')!r})"
            + (hint if "model_type" in meta or "architectures" in meta else "")
        )
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{cfg_file} has format_version={meta.get('format_version')!r}; this nanolight reads "
            f"version {FORMAT_VERSION} only"
        )
    config = LlamaConfig.from_dict(meta)
    sharding = meta.get("sharding")
    if sharding is not None and not (
        isinstance(sharding, dict) and sharding.get("index") in (None, INDEX_FILE) and "prefix" in sharding
    ):
        raise ValueError(
            f'{cfg_file} has "sharding": {sharding!r}; expected null or '
            f'{{"index": "{INDEX_FILE}" or null, "prefix": "<module attribute>."}}'
        )
    prefix = (sharding or {}).get("prefix") or ""
    state_dict = CheckpointReader.open(path).model_state(strip_prefix=prefix)
    if config.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)  # an alias of the embedding, stored once
    return config, state_dict, dict(meta.get("hf_extra") or {})


# ---------------------------------------------------------------------- model level
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
    return write_model_directory(
        path, model.config, model_state_dict(model), hf_extra, tokenizer_dir, overwrite
    )


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
    config, hf_extra = config_from_hf(read_hf_config(src))
    if not ((src / WEIGHTS_FILE).is_file() or (src / HF_INDEX).is_file()):
        raise FileNotFoundError(
            f"no {WEIGHTS_FILE} or {HF_INDEX} in {src}; only safetensors checkpoints are read "
            "(re-save a .bin checkpoint with safe_serialization=True)"
        )
    weights = CheckpointReader.open(src)  # one tensor at a time, from the memory-mapped files
    names = {name.removeprefix("model/") for name in weights.names("model/")}
    sd = hf_to_nanolight_state_dict(config, lambda name: weights.read(f"model/{name}"), names)
    return write_model_directory(save_path, config, sd, hf_extra, src, overwrite)


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
    _check_distinct(src, save_path)
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


def _check_distinct(src: Path, save_path: str | Path) -> None:
    if Path(save_path).absolute().resolve() == src.absolute().resolve():
        raise ValueError(f"save path {save_path} is the checkpoint being converted; choose another directory")
