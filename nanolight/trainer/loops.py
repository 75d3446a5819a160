"""The fit loop: epochs of optimizer steps, validation when due, stopping -- Lightning's fit and
training-epoch loops, in one place.

Per accumulation window (one optimizer step; one batch under manual optimization):
the step (`step.py`), its logger row, validation if one of the window's batches is
a check batch (an int ``val_check_interval`` counts batches, a float is a fraction of the
epoch), plateau schedulers with interval "step", then the pre-emption check (with
several ranks it reads the agreement the previous step started: `preemption.py`); ``max_time`` is
Lightning's `Timer` callback, which the trainer adds.
At an epoch's end: epoch values published, ``on_train_epoch_end`` (monitoring callbacks after the
module, what it logged published for them), plateau schedulers (only after a complete epoch), the
epoch row. Stopping: max steps/epochs, or ``should_stop`` once ``min_steps``/``min_epochs`` are
met (with one extra validation right then, as Lightning).

Where training stands in its data is `FitLoop`'s state, so a resumed run continues from the next
unseen batch: loaders with ``state_dict()/load_state_dict()`` (the nanolight data loader) are
restored through those and simply continue; a plain ``DataLoader`` is resumed by re-creating the
epoch's iterator *with the RNG state it was created with* (a shuffled ``RandomSampler`` draws its
permutation seed from the global torch generator, or the loader's/sampler's own, when the
iterator is created) and skipping the micro-batches already consumed. The trainer's RNG states at
checkpoint time are restored *after* the skip, so the run continues as an uninterrupted one.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from itertools import islice
from typing import TYPE_CHECKING, Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_info, rank_zero_warn

from nanolight.errors import UsageError
from nanolight.seed import restore_rng_state
from nanolight.trainer.data import set_epoch
from nanolight.trainer.evaluation import run_evaluation
from nanolight.trainer.step import AutomaticStep, ManualStep

if TYPE_CHECKING:
    from nanolight.trainer.trainer import NanoTrainer


def _limit(name: str) -> property:
    """A loop limit set on the fit loop (``trainer.fit_loop.max_epochs = 4``, Lightning), kept in the config."""
    return property(
        lambda self: getattr(self.trainer.config, name), lambda self, v: setattr(self.trainer.config, name, v)
    )


class FitLoop:
    """Runs `fit`'s epochs; `state_dict` / `load_state_dict` are its part of a checkpoint."""

    max_epochs, min_epochs, max_steps, min_steps = map(
        _limit, ("max_epochs", "min_epochs", "max_steps", "min_steps")
    )

    def __init__(self, trainer: NanoTrainer) -> None:
        self.trainer = trainer
        self.train_loader: Any = None
        self.val_loaders: list[Any] | None = None
        self.max_batches: int | float = math.inf  # training batches per epoch
        self.val_check_batch = math.inf
        self._epoch_start: dict[str, Any] | None = None  # RNG that ordered this epoch's samples
        self._resume: dict[str, Any] | None = None  # loop position read from a checkpoint
        self._resume_rng: dict[str, Any] | None = None
        self._told_min = False
        self.window_open = False  # between a window's step and its `stepped` count (checkpoints)
        self.ending_epoch = False  # a complete epoch's end hooks: a checkpoint saved now resumes at the next
        self.batch_idx = -1  # the training batch being run (set by the step), -1 before the first
        self.epoch_cut = False  # on_train_batch_start ended this epoch

    @property
    def is_last_batch(self) -> bool:
        """The batch being run is the epoch's last (known for loaders with a length), or
        ``on_train_batch_start`` returned -1 and ended the epoch."""
        return self.epoch_cut or self.batch_idx == self.max_batches - 1

    # ---- checkpoint state ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        loader = self.train_loader
        return {
            "batch_idx": self.trainer.progress["batch_idx"],
            "epoch_done": self.ending_epoch,
            "epoch_start": self._epoch_start,
            "loader": loader.state_dict() if is_stateful(loader) else None,
        }

    def load_state_dict(self, loop: dict[str, Any] | None, rng: dict[str, Any] | None) -> None:
        """Continue from `loop` at the next epoch start; the RNG states are restored after the skip."""
        self._resume, self._resume_rng = loop, rng

    @property
    def restarting(self) -> bool:
        """Resumed into a run that was not at an epoch boundary, or a step-based run (Lightning
        then skips the sanity check)."""
        resume = self._resume
        if resume is None or resume.get("epoch_done"):  # a finished epoch: the next starts afresh
            return False
        return self.trainer.config.max_steps != -1 or bool(resume.get("batch_idx"))

    # ---- data ------------------------------------------------------------------------------
    def forget_data(self) -> None:
        """A new fit: its loaders are requested again (Lightning's ``attach_dataloaders``)."""
        self.train_loader = self.val_loaders = None  # (ensure_train_data sets the limits again)

    def ensure_train_data(self) -> int | float:
        """The train loader (requested once per fit) and its number of batches per epoch."""
        trainer = self.trainer
        if self.train_loader is None:
            self.train_loader = trainer.data.request("train")[0]
            self.max_batches = trainer.num_training_batches = trainer.data.num_batches(
                self.train_loader, "train"
            )
            self._val_check_batch()
        return self.max_batches

    def _val_check_batch(self) -> None:
        cfg, trainer = self.trainer.config, self.trainer
        vci = cfg.val_check_interval
        if isinstance(vci, int):
            if (
                vci > self.max_batches
                and cfg.check_val_every_n_epoch is not None
                and trainer.enable_validation
            ):
                raise UsageError(
                    f"val_check_interval={vci} is more than the {self.max_batches:g} training batches of an "
                    "epoch: lower it, or pass check_val_every_n_epoch=None to count batches across epochs"
                )
            self.val_check_batch = vci
        elif self.max_batches == math.inf:
            if vci != 1.0:
                raise UsageError(
                    f"val_check_interval={vci}: a fraction needs a train loader with a length; give an int"
                )
            self.val_check_batch = math.inf
        else:
            self.val_check_batch = max(1, int(self.max_batches * vci))

    def ensure_val_data(self) -> list[Any]:
        trainer = self.trainer
        if self.val_loaders is None:
            self.val_loaders = trainer.data.request("val")
        return self.val_loaders

    # ---- stopping --------------------------------------------------------------------------
    @property
    def can_stop_early(self) -> bool:
        """``min_epochs``/``min_steps`` met; ``min_steps`` alone implies ``min_epochs=1`` (Lightning's
        ``_parse_loop_limits``): a stop asked for in the first epoch finishes it."""
        cfg, trainer = self.trainer.config, self.trainer
        min_epochs = cfg.min_epochs if cfg.min_epochs is not None else int(cfg.min_steps is not None)
        met_epochs = trainer.current_epoch >= min_epochs if min_epochs else True
        met_steps = trainer.global_step >= cfg.min_steps if cfg.min_steps else True
        return met_epochs and met_steps

    def _stop_requested(self) -> bool:
        if not self.trainer.should_stop:
            return False
        if not self.can_stop_early and not self._told_min:
            self._told_min = True
            cfg = self.trainer.config
            rank_zero_info(
                f"Trainer was signaled to stop but the required `min_epochs={cfg.min_epochs!r}` or "
                f"`min_steps={cfg.min_steps!r}` has not been met. Training will continue..."
            )
        return self.can_stop_early

    @property
    def done(self) -> bool:
        cfg = self.trainer.config
        if self.max_batches == 0 or (cfg.max_epochs != -1 and self.trainer.current_epoch >= cfg.max_epochs):
            return True
        return self._steps_done

    @property
    def _steps_done(self) -> bool:
        """``max_steps`` reached, or a stop requested that ``min_steps`` / ``min_epochs`` allow."""
        cfg = self.trainer.config
        return (cfg.max_steps != -1 and self.trainer.global_step >= cfg.max_steps) or self._stop_requested()

    # ---- the loop --------------------------------------------------------------------------
    def run(self) -> None:
        trainer = self.trainer
        self.ensure_train_data()
        if self.max_batches == 0 and not (0 <= trainer.config.max_steps <= trainer.global_step):
            rank_zero_warn(
                "the train dataloader has no batches (or limit_train_batches=0): fit stopped without training"
            )
        if self.done or trainer.config.limit_train_batches == 0:
            return
        self._skip_finished_epoch()
        # Lightning leaves the train/eval modes as they are (no train() call a module could see); it warns
        frozen = [n or "the module" for n, m in trainer.lightning_module.named_modules() if not m.training]
        if frozen:
            rank_zero_warn(
                f"modules in eval mode at the start of training (ignore if intended): {frozen[:5]}"
            )
        trainer.hooks.call("on_train_start")
        while not self.done:
            self._epoch()
        trainer.preemption.finish()  # the last step's agreement: none left in flight
        trainer.hooks.call("on_train_end")

    def _skip_finished_epoch(self) -> None:
        """Resumed from a checkpoint saved by the epoch-end hooks (a ModelCheckpoint's save at
        ``on_train_epoch_end``): that epoch is over, so training starts the next one, as Lightning's
        restored epoch progress does -- its end hooks do not run twice."""
        resume = self._resume
        if resume is None or not resume.get("epoch_done"):
            return
        self._resume = None
        if self._resume_rng is not None:  # before the new epoch's iterator draws its order
            restore_rng_state(self._resume_rng)
            self._resume_rng = None
        self.trainer.progress["epoch"] += 1
        self.trainer.progress["batch_idx"] = 0

    def _validates_epoch(self) -> bool:
        """Fit validates, and in this epoch (``check_val_every_n_epoch``)."""
        every = self.trainer.config.check_val_every_n_epoch
        epoch_due = every is None or (self.trainer.current_epoch + 1) % every == 0
        return epoch_due and self.trainer.enable_validation

    def _iterator(self) -> Iterator:
        """Iterator for the current epoch, positioned after the batches a checkpoint consumed."""
        trainer, loader = self.trainer, self.train_loader
        resume, self._resume = self._resume, None
        stateful = is_stateful(loader)
        set_epoch(loader, trainer.current_epoch)
        if resume is not None and stateful and resume.get("loader") is not None:
            loader.load_state_dict(resume["loader"])
        if resume is not None:
            restore_epoch_start(loader, resume["epoch_start"])
        self._epoch_start = capture_epoch_start(loader)
        iterator = iter(loader)
        self.epoch_cut = False
        if resume is not None and not stateful:
            for _ in range(resume["batch_idx"]):  # the batches the checkpoint consumed
                next(iterator)
        if self._resume_rng is not None:
            restore_rng_state(self._resume_rng)
            self._resume_rng = None
        if resume is None:
            trainer.progress["batch_idx"] = 0
        self.batch_idx = -1
        return iterator

    def _epoch(self) -> None:
        trainer, cfg = self.trainer, self.trainer.config
        every = cfg.reload_dataloaders_every_n_epochs
        if every and trainer.current_epoch and trainer.current_epoch % every == 0:
            self.train_loader = None  # Lightning: ask for the train loader again
            self.ensure_train_data()
        mid_epoch = bool((self._resume or {}).get("batch_idx"))  # resumed: its start hooks ran before
        iterator = self._iterator()
        if self.trainer.enable_validation:  # Lightning asks for them once the train iterator exists
            self.ensure_val_data()
        if not mid_epoch:
            trainer.hooks.call("on_train_epoch_start")
        manual = not trainer.lightning_module.automatic_optimization
        step = ManualStep(trainer) if manual else AutomaticStep(trainer)
        window = 1 if manual else cfg.accumulate_grad_batches
        complete = False
        while not self._steps_done:
            first = trainer.progress["batch_idx"]
            left = self.max_batches - first
            batches = list(islice(iterator, int(min(window, left)))) if left > 0 else []
            if not batches:
                if first == 0:
                    raise UsageError(
                        "the train dataloader yielded no batches: check the dataset and batch size"
                    )
                complete = True
                break
            trainer.progress["batch_idx"] += len(batches)
            last = trainer.progress["batch_idx"] == self.max_batches
            self.window_open = True
            if not step.run(batches, first, last):  # on_train_batch_start returned -1: the epoch ends
                self.window_open, self.epoch_cut, complete = False, True, True
                batch_idx = trainer.progress["batch_idx"] - 1  # its epoch schedulers step (Lightning)
                trainer.optimization.update_lr_schedulers("epoch", plateau=False, batch_idx=batch_idx)
                break
            trainer.metrics.step_row()
            self._after_window(first, len(batches), last)
            if last:
                complete = True
                break
        if complete and self.val_check_batch == math.inf and self._validates_epoch():
            self.validate()  # an unsized loader: its last batch is known only now
        self._epoch_end(complete)

    def _after_window(self, first: int, n: int, last: bool) -> None:
        trainer = self.trainer
        trainer.progress["total_batch_idx"] += n
        if self._validation_due(first, n, last):
            trainer.hooks.module("on_validation_model_zero_grad")
            self.validate()
        trainer.optimization.update_lr_schedulers("step", plateau=True, batch_idx=first + n - 1)
        trainer.progress["stepped"] += 1
        self.window_open = False
        trainer.preemption.check()

    def _validation_due(self, first: int, n: int, last: bool) -> bool:
        if not self._validates_epoch():
            return False
        if self.trainer.should_stop and self.can_stop_early:
            return True
        vcb = self.val_check_batch
        if vcb == math.inf:
            return False  # checked at the end of an unsized epoch
        per_epoch = self.trainer.config.check_val_every_n_epoch is not None
        start = first if per_epoch else self.trainer.progress["total_batch_idx"] - n
        return any((start + k + 1) % vcb == 0 for k in range(n))

    def validate(self) -> None:
        """One validation pass now, as the loop runs one when due (the recipe also runs one before
        step 1 and after the last step: `pretrain/report.py`)."""
        trainer = self.trainer
        trainer.state.stage = "validate"
        try:
            run_evaluation(trainer, "val", self.ensure_val_data())
        finally:
            trainer.state.stage = "train"

    def _epoch_end(self, complete: bool) -> None:
        trainer = self.trainer
        metrics = trainer.metrics
        metrics.publish(metrics.train, on_step=False)  # epoch values first: the hooks read them
        self.ending_epoch = complete  # (an epoch cut short by max_steps resumes inside it)
        try:
            trainer.hooks.call("on_train_epoch_end", monitoring=False)
            metrics.publish(metrics.train, on_step=False)  # + what those hooks logged, for the monitors
            trainer.hooks.call("on_train_epoch_end", monitoring=True)
        finally:
            self.ending_epoch = False
        if complete:
            batch_idx = trainer.progress["batch_idx"] - 1
            trainer.optimization.update_lr_schedulers("epoch", plateau=True, batch_idx=batch_idx)
        metrics.epoch_row()
        trainer.progress["epoch"] += 1
        trainer.progress["batch_idx"] = 0


# ---- where training stands in its data -----------------------------------------------------
def is_stateful(loader: Any) -> bool:
    """The loader saves and restores its own position (the nanolight data loader)."""
    return all(callable(getattr(loader, name, None)) for name in ("state_dict", "load_state_dict"))


def _generators(loader: Any) -> list[torch.Generator | None]:
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    inner = getattr(batch_sampler, "sampler", None)
    return [
        getattr(loader, "generator", None),
        getattr(sampler, "generator", None),
        getattr(inner, "generator", None) if inner is not sampler else None,
    ]


def capture_epoch_start(loader: Any) -> dict[str, Any]:
    """RNG state that decides this epoch's sample order (before ``iter(loader)``)."""
    gens = [g.get_state() if g is not None else None for g in _generators(loader)]
    return {"torch": torch.get_rng_state(), "generators": gens}


def restore_epoch_start(loader: Any, state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    for gen, saved in zip(_generators(loader), state["generators"], strict=False):
        if gen is not None and saved is not None:
            gen.set_state(saved)
