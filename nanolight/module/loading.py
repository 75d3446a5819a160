"""``load_from_checkpoint``: rebuild a module from a checkpoint directory of any parallel layout --
its class called with the saved hparams, then the weights -- or a datamodule (hparams, then its
state)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from lightning_utilities.core.overrides import is_overridden

from nanolight.checkpoint.atomic import MissingCheckpointFile, resolve_checkpoint
from nanolight.checkpoint.load import load_model
from nanolight.checkpoint.reader import CheckpointReader
from nanolight.errors import UsageError
from nanolight.module.hooks import ModelHooks
from nanolight.parallel.layout import ModelLayout

if TYPE_CHECKING:
    from nanolight.module.module import NanoDataModule, NanoModule

HPARAMS_KEY = "hyper_parameters"  # where the trainer stores ``module.hparams`` (Lightning's key)


def load_module(
    cls: type[NanoModule],
    checkpoint_path: str | Path,
    map_location: Any,
    hparams_file: str | Path | None,
    strict: bool | None,
    kwargs: dict[str, Any],
) -> NanoModule:
    if strict is False:
        raise UsageError(
            "load_from_checkpoint(strict=False) is not supported: a nanolight checkpoint must match the "
            "module; load a subset yourself with nanolight.checkpoint.reader.CheckpointReader"
        )
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
    init = inspect.signature(cls.__init__).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in init.values()):  # saved hparams the class no longer takes
        hparams = {k: v for k, v in hparams.items() if k in init}
    module = cls(**{**hparams, **kwargs})
    if is_overridden("configure_model", module, ModelHooks):
        module.configure_model()
    module.on_load_checkpoint(state)
    load_model(reader, module, ModelLayout.whole(module))
    if map_location is not None:
        module.to(map_location)
    return module


def load_datamodule(
    cls: type[NanoDataModule], checkpoint_path: str | Path, kwargs: dict[str, Any]
) -> NanoDataModule:
    """``cls(**saved hparams, **kwargs)``, then its saved state."""
    state = CheckpointReader.open(checkpoint_path).trainer_state()
    saved = state.get("datamodule_hyper_parameters") or {}
    dm = cls(**{**saved, **kwargs})
    if type(dm).__qualname__ in state.get("datamodule", {}):
        dm.load_state_dict(state["datamodule"][type(dm).__qualname__])
    return dm
