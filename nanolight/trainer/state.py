"""The trainer's part of a checkpoint: built, restored, and found (``ckpt_path="last"``).

The strategy writes and reads the files; this is what goes into ``trainer_state.pt``. Every value
is a tensor or a plain container, so ``torch.load(weights_only=True)`` reads it back.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_utilities.core.rank_zero import rank_zero_warn

from nanolight.checkpoint.atomic import (
    LAST_POINTER,
    CheckpointError,
    MissingCheckpointFile,
    resolve_checkpoint,
    with_hint,
)
from nanolight.checkpoint.reader import TRAINER_FILE, newest_intact
from nanolight.errors import UsageError
from nanolight.module.hparams import plain_hparams
from nanolight.module.loading import HPARAMS_KEY, HPARAMS_NAME_KEY
from nanolight.seed import capture_rng_state

if TYPE_CHECKING:
    from nanolight.trainer.trainer import NanoTrainer

FORMAT = "nanolight-trainer-v1"


def build_state(trainer: NanoTrainer, weights_only: bool = False) -> dict[str, Any]:
    """Everything but weights/optimizer: progress, loop position, schedulers, callbacks, RNG, the
    module's (and datamodule's) hparams and the datamodule's state. `weights_only`: what rebuilding
    the module needs, nothing to resume training from (Lightning's ``save_weights_only``)."""
    module, dm = trainer.lightning_module, trainer.datamodule
    state: dict[str, Any] = {
        "format": FORMAT,
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "weights_only": weights_only,
        HPARAMS_KEY: plain_hparams(module.hparams, type(module).__name__),
        HPARAMS_NAME_KEY: module.hparams_name,
    }
    if dm is not None:
        state["datamodule_hyper_parameters"] = plain_hparams(dm.hparams, type(dm).__name__)
        state["datamodule_hparams_name"] = dm.hparams_name
    if not weights_only:
        state.update(
            progress=_progress(trainer),
            loop=trainer.fit_loop.state_dict(),
            schedulers=[cfg.scheduler.state_dict() for cfg in trainer.lr_scheduler_configs],
            callbacks={cb.state_key: cb.state_dict() for cb in trainer.callbacks},
            rng=capture_rng_state(),
        )
        if dm is not None:
            state["datamodule"] = {type(dm).__qualname__: dm.state_dict()}
        trainer.hooks.call("on_save_checkpoint", state)  # callbacks, then the module
    else:
        trainer.hooks.module("on_save_checkpoint", state)
    return state


def _progress(trainer: NanoTrainer) -> dict[str, int]:
    """The counters as a resumed run needs them: a save inside a step's hooks (e.g. at its
    on_train_batch_end) counts that step as stepped, as it will be once the hooks return (one inside ``on_train_epoch_end``
    resumes at the next epoch's start: the loop's state says the epoch is done)."""
    progress = dict(trainer.progress)
    if trainer.fit_loop.window_open:
        progress["stepped"] += 1
    return progress


def restore_state(trainer: NanoTrainer, path: Path) -> dict[str, Any]:
    """Load ``path`` through the strategy and put the trainer/callbacks back where they were.

    Order: weights (the strategy checks they match the model), module ``on_load_checkpoint``,
    callbacks' ``on_load_checkpoint`` then their ``load_state_dict`` (as in Lightning); the
    optimizer/scheduler/progress part follows in `restore_training_state`.
    """
    module, strategy = trainer.lightning_module, trainer.strategy
    with _naming_an_intact_one(path):
        state = strategy.load_checkpoint(path, load_optimizer=False)
    trainer.hooks.module("on_load_checkpoint", state)
    for cb in trainer.callbacks:
        cb.on_load_checkpoint(trainer, module, state)
    saved = state.get("callbacks", {})
    for cb in trainer.callbacks:
        if cb.state_key in saved:
            cb.load_state_dict(saved[cb.state_key])
    dm = trainer.datamodule
    if dm is not None and type(dm).__qualname__ in state.get("datamodule", {}):
        dm.load_state_dict(state["datamodule"][type(dm).__qualname__])
    return state


def restore_training_state(trainer: NanoTrainer, path: Path, state: dict[str, Any]) -> None:
    if state.get("weights_only"):
        raise UsageError(
            f"checkpoint {path} holds only weights (saved with save_checkpoint(weights_only=True) or "
            "ModelCheckpoint(save_weights_only=True)): no optimizer, LR scheduler or loop state to resume "
            "training from. Start a new fit from its weights (Module.load_from_checkpoint), or resume "
            "from a full checkpoint"
        )
    with _naming_an_intact_one(path):
        if "progress" not in state:  # a model directory, or a checkpoint whose trainer state is gone
            raise MissingCheckpointFile(
                f"checkpoint file {path / TRAINER_FILE} is missing: {path} holds no trainer state to resume "
                "training from; restore the file or resume from an earlier checkpoint"
            )
        trainer.strategy.load_checkpoint(path, load_weights=False)
    scheds = state.get("schedulers", [])
    if len(scheds) != len(trainer.lr_scheduler_configs):
        raise UsageError(
            f"checkpoint holds {len(scheds)} LR scheduler state(s), configure_optimizers returned "
            f"{len(trainer.lr_scheduler_configs)}"
        )
    for cfg, sd in zip(trainer.lr_scheduler_configs, scheds, strict=True):
        cfg.scheduler.load_state_dict(sd)
    saved = state.get("progress", {})
    trainer.progress.update(saved)
    if "stepped" not in saved:  # a checkpoint from before the counter existed
        trainer.progress["stepped"] = trainer.progress["global_step"]
    trainer.fit_loop.load_state_dict(state.get("loop"), state.get("rng"))
    max_epochs = trainer.config.max_epochs
    if max_epochs not in (None, -1) and trainer.current_epoch > max_epochs:  # Lightning's check
        raise UsageError(
            f"You restored a checkpoint with current_epoch={trainer.current_epoch}, but you have set "
            f"NanoTrainer(max_epochs={max_epochs}): raise max_epochs to continue training"
        )


@contextmanager
def _naming_an_intact_one(path: Path) -> Iterator[None]:
    """A damaged checkpoint's error also names the newest intact one next to it, to resume from."""
    try:
        yield
    except CheckpointError as exc:
        other = newest_intact(Path(path).parent, exclude=path)
        if other is None:
            raise
        hint = f"the newest intact checkpoint is {other}: resume from it (ckpt_path='{other}', recipe: checkpoint.resume={other})"
        raise with_hint(exc, hint) from exc


def resolve_ckpt_path(
    trainer: NanoTrainer, ckpt_path: str | Path | None, fn: str, model_given: bool
) -> Path | None:
    """Lightning's rules: None restores nothing (fit, or a model was passed) or else the best
    checkpoint of the fit before; ``"best"`` -> the first ModelCheckpoint's best; ``"last"`` ->
    for fit, the newest complete checkpoint (the ``last`` pointer: resuming), otherwise the
    ModelCheckpoints' ``last_model_path`` as Lightning (None + a warning if there is none); else a
    directory."""
    if ckpt_path is None and (fn == "fit" or model_given):
        return None
    if ckpt_path is None:
        ckpt_path = "best"
        rank_zero_warn(
            f"{fn}(ckpt_path=None) was called without a model: the best checkpoint of the previous fit is "
            f"used. Pass {fn}(ckpt_path='best') or {fn}(ckpt_path='last') to silence this"
        )
    if str(ckpt_path) == "best":
        cb = trainer.checkpoint_callback
        if cb is None:
            raise UsageError(f'{fn}(ckpt_path="best") but there is no ModelCheckpoint callback')
        if not cb.best_model_path:
            raise UsageError(
                f'{fn}(ckpt_path="best") but the ModelCheckpoint has saved nothing yet: pass a checkpoint '
                f"directory as {fn}(ckpt_path=...)"
            )
        ckpt_path = cb.best_model_path
    elif str(ckpt_path) == LAST_POINTER and fn != "fit":
        # Lightning: the ModelCheckpoints' last_model_path (set by save_last), else the weights in memory
        last = [cb.last_model_path for cb in trainer.checkpoint_callbacks if cb.last_model_path]
        found = next((p for p in map(resolve_checkpoint, last) if p is not None), None)
        if found is None:
            rank_zero_warn(
                f'.{fn}(ckpt_path="last") is set, but there is no last checkpoint available: the weights in '
                "memory are used. Set ModelCheckpoint(..., save_last=True) to have one"
            )
        return found
    elif str(ckpt_path) == LAST_POINTER:  # resuming: the newest complete checkpoint
        dirs = [Path(cb.dirpath) for cb in trainer.checkpoint_callbacks if cb.dirpath is not None]
        dirs.append(Path(trainer.default_root_dir) / "checkpoints")
        for d in dirs:
            found = resolve_checkpoint(d / LAST_POINTER)
            if found is not None:
                return found
        rank_zero_warn(f'{fn}(ckpt_path="last"): no checkpoint found under {dirs[0]}; nothing is restored')
        return None
    found = resolve_checkpoint(ckpt_path)
    if found is None:
        raise MissingCheckpointFile(
            f"checkpoint {ckpt_path} does not exist: pass a checkpoint directory, 'best' or 'last'"
        )
    return found
