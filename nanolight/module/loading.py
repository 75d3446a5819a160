"""``load_from_checkpoint``: rebuild a module from a checkpoint directory of any parallel layout --
its class called with the saved hparams (under their ``__init__`` argument's name when they were
saved from one dict), then the weights (``strict=False``: keys absent on either side allowed, as
Lightning) -- or a datamodule (hparams, then its state)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from lightning_utilities.core.overrides import is_overridden
from lightning_utilities.core.rank_zero import rank_zero_warn

from nanolight.checkpoint.atomic import MissingCheckpointFile, resolve_checkpoint
from nanolight.checkpoint.load import load_model
from nanolight.checkpoint.reader import CheckpointReader
from nanolight.errors import UsageError
from nanolight.module.hooks import ModelHooks
from nanolight.parallel.layout import ModelLayout

if TYPE_CHECKING:
    from nanolight.module.module import NanoDataModule, NanoModule

HPARAMS_KEY = "hyper_parameters"  # where the trainer stores ``module.hparams`` (Lightning's key)
HPARAMS_NAME_KEY = "hparams_name"  # the __init__ argument they came in as (Lightning's key)


def load_module(
    cls: type[NanoModule],
    checkpoint_path: str | Path,
    map_location: Any,
    hparams_file: str | Path | None,
    strict: bool | None,
    kwargs: dict[str, Any],
) -> NanoModule:
    path = resolve_checkpoint(checkpoint_path)
    if path is None:
        raise MissingCheckpointFile(
            f"checkpoint {checkpoint_path} does not exist: pass a checkpoint directory"
        )
    reader = CheckpointReader.open(path)
    state = reader.trainer_state()
    hparams = dict(state.get(HPARAMS_KEY) or {})
    if hparams_file is not None:
        hparams = dict(yaml.safe_load(Path(hparams_file).read_text()) or {})
    module = cls(**init_kwargs(cls, hparams, state.get(HPARAMS_NAME_KEY), kwargs))
    strict_loading = getattr(module, "strict_loading", None)
    if strict is not None and strict_loading is not None and strict != strict_loading:
        raise UsageError(
            f"load_from_checkpoint(strict={strict}) conflicts with {cls.__name__}.strict_loading={strict_loading}: "
            "set the same value for both"
        )
    strict = (True if strict_loading is None else strict_loading) if strict is None else strict
    if is_overridden("configure_model", module, ModelHooks):
        module.configure_model()
    module.on_load_checkpoint(state)
    missing, unexpected = load_model(reader, module, ModelLayout.whole(module), strict=strict)
    if missing:
        rank_zero_warn(f"Found keys that are in the model state dict but not in the checkpoint: {missing}")
    if unexpected:
        rank_zero_warn(f"Found keys that are not in the model state dict but in the checkpoint: {unexpected}")
    if map_location is not None:
        module.to(map_location)
    return module


def init_kwargs(
    cls: type, hparams: dict[str, Any], hparams_name: str | None, given: dict[str, Any]
) -> dict[str, Any]:
    """The constructor's keywords, as Lightning's ``_load_state``: hparams saved from one
    ``__init__`` argument (``save_hyperparameters(config)``) go back under its name; the
    keywords given win; saved names the class no longer takes are dropped (unless ``**kwargs``)."""
    init = {
        name: p
        for name, p in inspect.signature(cls.__init__).parameters.items()
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }
    loaded = {hparams_name: hparams} if hparams_name and hparams_name in init else hparams
    out = {**loaded, **given}
    if not any(p.kind is p.VAR_KEYWORD for p in inspect.signature(cls.__init__).parameters.values()):
        out = {k: v for k, v in out.items() if k in init}
    return out


def load_datamodule(
    cls: type[NanoDataModule], checkpoint_path: str | Path, kwargs: dict[str, Any]
) -> NanoDataModule:
    """``cls(**saved hparams, **kwargs)``, then its saved state."""
    state = CheckpointReader.open(checkpoint_path).trainer_state()
    saved = state.get("datamodule_hyper_parameters") or {}
    dm = cls(**init_kwargs(cls, saved, state.get("datamodule_hparams_name"), kwargs))
    if type(dm).__qualname__ in state.get("datamodule", {}):
        dm.load_state_dict(state["datamodule"][type(dm).__qualname__])
    return dm
