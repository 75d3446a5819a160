"""Model directories: a whole model's files read and written, whatever the model.

A model directory is ``config.json`` (`save.write_config`: the model's own fields, the format's
tags, ``"hf_extra"`` -- the HF-only keys such as bos/eos/pad token ids, carried through HF ->
nanolight -> HF unchanged), one ``model.safetensors`` of full tensors (a tied lm_head is not
stored), and the tokenizer files, copied verbatim so ``AutoTokenizer.from_pretrained(dir)`` works.
Its ``"sharding"`` is null; a training step directory is a model directory too, with
``{"index": "index.json", "prefix": "model."}`` (the module's shards, the model's tensors under
that prefix).

Which model the fields describe is the model's business: `models/pretrained.py` builds, loads and
converts the Llama on top of these reads and writes (this package imports nothing from `models/`).
Directories are written atomically (`atomic.py`).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import torch

from nanolight.checkpoint.atomic import (
    CheckpointError,
    MissingCheckpointFile,
    atomic_directory,
    load_json,
    resolve_checkpoint,
    save_tensors,
)
from nanolight.checkpoint.index import INDEX_FILE, UPGRADE_HINT
from nanolight.checkpoint.reader import CONFIG_FILE, TRAINER_FILE, WEIGHTS_FILE, CheckpointReader
from nanolight.checkpoint.save import FORMAT_NAME, FORMAT_VERSION, ExportExtras, write_config

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
    fields: dict[str, Any],
    state_dict: dict[str, torch.Tensor],
    hf_extra: dict[str, Any] | None,
    tokenizer_dir: str | Path | None,
    overwrite: bool,
) -> Path:
    """config.json (the model's `fields`), model.safetensors and the tokenizer files found in
    `tokenizer_dir`, atomically."""
    with atomic_directory(path, overwrite=overwrite) as tmp:
        write_config(tmp, fields, None, {"hf_extra": hf_extra or {}})
        save_tensors(tmp / WEIGHTS_FILE, state_dict)
        run_extras(tokenizer_dir).copy_into(tmp)
    return Path(path)


def read_model_directory(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any]]:
    """Read a nanolight checkpoint directory -> (its config.json, the model's state_dict, hf_extra).

    A model directory (one `model.safetensors`) or a training step directory saved at any
    layout, whose config.json says `"sharding": {"index": "index.json", "prefix": "model."}`
    (the weights are reassembled from the shards, `reader.py`). Only the tensors under `prefix` (the module attribute holding the causal
    LM) are kept and the prefix is removed. Either way the state dict has nanolight parameter names
    and full tensors (a tied `lm_head.weight` as its alias, which the model drops). `path` may also name a run's newest step as the
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
    if meta.get("format_version") == 1:  # the MLP's gate_up rows interleaved
        raise CheckpointError(
            f"{path} is a nanolight directory of format version 1: " + UPGRADE_HINT.format(path=path)
        )
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{cfg_file} has format_version={meta.get('format_version')!r}; this nanolight reads "
            f"version {FORMAT_VERSION} only"
        )
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
    return meta, state_dict, dict(meta.get("hf_extra") or {})


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


def check_distinct(src: Path, save_path: str | Path) -> None:
    """A conversion never writes over its source."""
    if Path(save_path).absolute().resolve() == src.absolute().resolve():
        raise ValueError(f"save path {save_path} is the checkpoint being converted; choose another directory")
