"""The nanolight pretrained-checkpoint format: save and load a whole model.

A checkpoint is a directory:

    config.json         LlamaConfig fields (rope_scaling omitted when null), plus
                          "format": "nanolight", "format_version": 1,
                          "sharding": null   -- one file (below); a training step directory says
                                                {"index": "index.json", "prefix": "model."} for
                                                Parallel3DStrategy's per-rank shards described by
                                                index.json (checkpoint/index.py), or {"index": null,
                                                "prefix": "model."} for SingleDeviceStrategy's one
                                                model.safetensors of the whole training module,
                          "hf_extra": {...}  -- HF-only keys (bos/eos/pad token ids) carried
                                                through HF -> nanolight -> HF unchanged
    model.safetensors   full (unsharded) tensors under nanolight parameter names; with tied
                        embeddings only `model.embed_tokens.weight` is stored
    tokenizer files     optional, copied verbatim so `AutoTokenizer.from_pretrained(dir)` works

Directories are written atomically (`atomic.py`), so an interrupted or failed save never leaves a
half-written checkpoint at the target; every layout is read by one reader (`reader.py`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from nanolight.checkpoint.atomic import atomic_directory
from nanolight.checkpoint.files import MissingCheckpointFile, save_tensors
from nanolight.checkpoint.index import INDEX_FILE
from nanolight.checkpoint.load import check_matches
from nanolight.checkpoint.reader import TRAINER_FILE, WEIGHTS_FILE, CheckpointReader
from nanolight.checkpoint.save import CONFIG_FILE
from nanolight.models.llama import LlamaForCausalLM
from nanolight.models.llama_config import LlamaConfig

FORMAT_NAME = "nanolight"
FORMAT_VERSION = 1
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

__all__ = ["load_pretrained", "save_pretrained", "read_checkpoint", "write_checkpoint"]


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy the tokenizer files found in `src` into `dst`; returns the names copied."""
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied


# ---------------------------------------------------------------------- raw read / write
def write_checkpoint(
    directory: str | Path,
    config: LlamaConfig,
    state_dict: dict[str, torch.Tensor],
    hf_extra: dict[str, Any] | None = None,
) -> None:
    """Write config.json + model.safetensors into an existing directory (no atomicity here)."""
    fields = config.to_dict()
    if fields["rope_scaling"] is None:
        # Omitted when unused: transformers' AutoTokenizer reads this config.json too, and warns
        # on any `rope_scaling` key (deprecated in 5.x). Absent reads back as None.
        del fields["rope_scaling"]
    meta = {
        **fields,
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "sharding": None,
        "hf_extra": hf_extra or {},
    }
    Path(directory, CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    save_tensors(Path(directory, WEIGHTS_FILE), state_dict)


def read_checkpoint(path: str | Path) -> tuple[LlamaConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """Read a nanolight checkpoint directory -> (config, state_dict, hf_extra).

    Three layouts hold the same thing: a pretrained directory (one `model.safetensors`), a
    training step directory saved by `Parallel3DStrategy` at any tp x pp x dp, whose config.json
    says `"sharding": {"index": "index.json", "prefix": "model."}` (the weights are reassembled
    from the per-rank shards, `nanolight.checkpoint.reader`), and one saved by
    `SingleDeviceStrategy` (`"index": null`: one `model.safetensors` of the whole training
    module). Only the tensors under `prefix` (the module attribute holding the causal LM) are
    kept and the prefix is removed. Either way the state dict has nanolight parameter names,
    full tensors, and no tied `lm_head.weight`.
    """
    path = Path(path)
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
    meta = json.loads(cfg_file.read_text())
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


def model_dir_files(module: torch.nn.Module) -> dict[str, Path]:
    """The tokenizer files a module's checkpoints carry, so an export is a complete HF directory:
    those found in its ``tokenizer_dir`` attribute (the recipe's module sets it)."""
    src = getattr(module, "tokenizer_dir", None)
    return {name: Path(src) / name for name in TOKENIZER_FILES if src and (Path(src) / name).is_file()}


def stored_model_prefix(path: str | Path) -> str:
    """The key prefix of the model's tensors in a nanolight directory ("" in a model directory,
    the module attribute in a training step directory, as its config.json says)."""
    cfg_file = Path(path) / CONFIG_FILE
    meta = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    return (
        ((meta.get("sharding") or {}).get("prefix") or "") if isinstance(meta.get("sharding"), dict) else ""
    )


def step_dir_meta(
    module: torch.nn.Module, pretrained: str | Path | None = None, index: str | None = INDEX_FILE
) -> dict[str, Any] | None:
    """``config.json`` for a *training* step directory whose module holds a nanolight Llama, so the
    directory is also a model directory (``load_pretrained``, HF conversion): this format's meta
    with ``"sharding": {"index": index, "prefix": <the model's key prefix>}`` -- `index` is
    ``index.json`` for per-rank shards, None for one ``model.safetensors`` of the whole module.
    A run started from `pretrained` keeps its ``hf_extra`` (HF token ids) for the way back to HF;
    otherwise the module's ``hf_extra`` attribute gives them. None when the module holds no
    ``LlamaForCausalLM``."""
    found = next(((n, m) for n, m in module.named_modules() if isinstance(m, LlamaForCausalLM)), None)
    if found is None:
        return None
    prefix, model = found
    fields = model.config.to_dict()
    if fields.get("rope_scaling") is None:
        fields.pop("rope_scaling", None)  # as write_checkpoint does
    hf_extra = dict(getattr(module, "hf_extra", None) or {})  # e.g. the run's tokenizer's token ids
    if pretrained is not None and (Path(pretrained) / CONFIG_FILE).is_file():
        hf_extra = json.loads((Path(pretrained) / CONFIG_FILE).read_text()).get("hf_extra") or hf_extra
    sharding = {"index": index, "prefix": f"{prefix}." if prefix else ""}
    return {
        **fields,
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "sharding": sharding,
        "hf_extra": hf_extra,
    }


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
        expected = model_state_dict(LlamaForCausalLM(_buildable(config)))
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
    with atomic_directory(path, overwrite=overwrite) as tmp:
        write_checkpoint(tmp, model.config, model_state_dict(model), hf_extra)
        if tokenizer_dir is not None:
            copy_tokenizer_files(tokenizer_dir, tmp)
    return Path(path)


def load_pretrained(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    attn_implementation: str | None = None,
) -> LlamaForCausalLM:
    """Load a nanolight checkpoint -> `LlamaForCausalLM` in eval mode; `model(input_ids)` -> logits.

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


def _buildable(config: LlamaConfig) -> LlamaConfig:
    """A copy that can be built anywhere (flash-attn availability is irrelevant to shapes)."""
    return LlamaConfig.from_dict({**config.to_dict(), "attn_implementation": "sdpa"})
