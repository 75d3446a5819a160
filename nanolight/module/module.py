"""What users subclass: `NanoModule` -- an ``nn.Module`` with Lightning's hooks and helpers -- and
`NanoDataModule`, Lightning's DataModule.

A user builds the model (in ``__init__`` or, for models too large for one device, in
`configure_model`: the trainer calls it inside the strategy's init context, e.g. the meta
device), writes `training_step` returning a scalar loss, and returns an optimizer (+ scheduler)
from `configure_optimizers`. With ``automatic_optimization = False`` the step drives the
optimizers itself (`manual_backward`, ``opt.step()``). Everything layout-specific is reached
through ``self.trainer.strategy``. The hooks and their defaults are in `hooks.py`.

A `NanoDataModule` holds the data of a run in one object, apart from the model: ``prepare_data``
runs once per node (local rank 0; the others wait), ``setup(stage)`` on every process at the start
of each trainer call, then the trainer asks for the loader it needs. ``state_dict`` is saved in
checkpoints (under the class's qualified name, as Lightning) and ``load_state_dict`` runs whenever
a checkpoint is restored. Its batch-transfer hooks, when overridden, take precedence over the
module's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch import nn

from nanolight.errors import UsageError
from nanolight.module.hooks import CheckpointHooks, DataHooks, ModelHooks
from nanolight.module.hparams import HyperparametersMixin
from nanolight.module.loading import load_datamodule, load_module
from nanolight.module.optimizers import NanoOptimizer

if TYPE_CHECKING:
    from nanolight.trainer import NanoTrainer


class NanoModule(HyperparametersMixin, DataHooks, ModelHooks, CheckpointHooks, nn.Module):
    """Base class for what `NanoTrainer` trains. Implement `training_step` and
    `configure_optimizers`; every other hook is optional."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # kept outside nn.Module's registries: the trainer is not a submodule
        object.__setattr__(self, "_trainer", None)
        self._automatic_optimization = True
        self._param_requires_grad_state: dict[nn.Parameter, bool] = {}

    # ---- wiring ------------------------------------------------------------------------
    @property
    def trainer(self) -> NanoTrainer:
        if self._trainer is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a NanoTrainer (call trainer.fit)")
        return self._trainer

    @trainer.setter
    def trainer(self, trainer: NanoTrainer | None) -> None:
        """Attached with the modules it holds (Lightning: an ensemble's members see its trainer)."""
        for child in self.children():
            if isinstance(child, NanoModule):
                child.trainer = trainer
        object.__setattr__(self, "_trainer", trainer)

    @property
    def automatic_optimization(self) -> bool:
        """False: `training_step` calls ``self.optimizers()``, `manual_backward` and ``opt.step()``."""
        return self._automatic_optimization

    @automatic_optimization.setter
    def automatic_optimization(self, value: bool) -> None:
        self._automatic_optimization = bool(value)

    @property
    def parallel_context(self) -> Any:
        """The strategy's ParallelContext; None on a single device or before fit."""
        return None if self._trainer is None else self._trainer.strategy.parallel.context

    @property
    def device(self) -> torch.device:
        if self._trainer is not None:
            return self._trainer.strategy.root_device
        param = next(self.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    @property
    def global_step(self) -> int:
        return 0 if self._trainer is None else self._trainer.global_step

    @property
    def current_epoch(self) -> int:
        return 0 if self._trainer is None else self._trainer.current_epoch

    @property
    def global_rank(self) -> int:
        return 0 if self._trainer is None else self._trainer.global_rank

    @property
    def local_rank(self) -> int:
        return 0 if self._trainer is None else self._trainer.local_rank

    @property
    def logger(self) -> Any:
        return None if self._trainer is None else self._trainer.logger

    @property
    def loggers(self) -> list[Any]:
        return [] if self._trainer is None else self._trainer.loggers

    # ---- logging -----------------------------------------------------------------------
    def log(
        self,
        name: str,
        value: Any,
        prog_bar: bool = False,
        logger: bool | None = None,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: str | Any = "mean",
        enable_graph: bool = False,
        sync_dist: bool = False,
        sync_dist_group: Any = None,
        add_dataloader_idx: bool = True,
        batch_size: int | None = None,
        metric_attribute: str | None = None,
        rank_zero_only: bool = False,
    ) -> None:
        """Record a scalar, as Lightning's ``self.log``: in training steps per step (the last
        micro-batch's value) by default, in evaluation and epoch-end hooks as an epoch value
        (the mean weighted by batch size). ``sync_dist`` reduces it over data-parallel ranks
        (one collective per step for all such metrics, through the strategy)."""
        if self._trainer is None:
            rank_zero_warn(
                f"self.log({name!r}) outside a trainer run is ignored (the module is not attached)"
            )
            return
        if self._trainer.barebones:  # Lightning's: logging costs raw speed, so it is off
            rank_zero_warn(f"self.log({name!r}) is ignored: NanoTrainer(barebones=True) turns logging off")
            return
        if sync_dist_group is not None:
            raise UsageError(
                "self.log(sync_dist_group=...) is not supported: sync_dist reduces over the dp group"
            )
        self._trainer.metrics.log(
            name,
            value,
            prog_bar=prog_bar,
            logger=True if logger is None else logger,
            on_step=on_step,
            on_epoch=on_epoch,
            reduce_fx=reduce_fx,
            sync_dist=sync_dist,
            batch_size=batch_size,
            add_dataloader_idx=add_dataloader_idx,
        )

    def log_dict(self, dictionary: dict[str, Any], **kwargs: Any) -> None:
        for name, value in dictionary.items():
            self.log(name, value, **kwargs)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank zero only."""
        if self._trainer is None or self._trainer.is_global_zero:
            print(*args, **kwargs)

    # ---- optimizers --------------------------------------------------------------------
    def optimizers(self, use_pl_optimizer: bool = True) -> NanoOptimizer | list[NanoOptimizer] | Any:
        """The optimizers of `configure_optimizers` (one object when there is one)."""
        opts = self.trainer.nano_optimizers if use_pl_optimizer else self.trainer.optimizers
        return opts[0] if len(opts) == 1 else list(opts)

    def lr_schedulers(self) -> Any:
        """The LR schedulers of `configure_optimizers`: None, one object, or a list."""
        scheds = [cfg.scheduler for cfg in self.trainer.lr_scheduler_configs]
        if not scheds:
            return None
        return scheds[0] if len(scheds) == 1 else scheds

    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Back-propagate in manual optimization, with the backward hooks (not under pp)."""
        if self.automatic_optimization:
            raise UsageError(
                "manual_backward is for manual optimization: set self.automatic_optimization = False, "
                "or return the loss from training_step and let the trainer back-propagate it"
            )
        self.trainer.backward(loss, *args, **kwargs)

    def toggle_optimizer(self, optimizer: Any) -> None:
        """Only `optimizer`'s parameters require grad until `untoggle_optimizer` (e.g. a GAN's
        generator step must not accumulate into the discriminator)."""
        state: dict[nn.Parameter, bool] = {}
        for opt in self.trainer.optimizers:
            for group in opt.param_groups:
                for param in group["params"]:
                    if param not in state:
                        state[param] = param.requires_grad
                        param.requires_grad = False
        for group in _unwrap(optimizer).param_groups:
            for param in group["params"]:
                param.requires_grad = state[param]
        self._param_requires_grad_state = state

    @contextmanager
    def toggled_optimizer(self, optimizer: Any) -> Iterator[None]:
        """`toggle_optimizer` for the block, `untoggle_optimizer` after it (even on an error)."""
        self.toggle_optimizer(optimizer)
        try:
            yield
        finally:
            self.untoggle_optimizer(optimizer)

    def untoggle_optimizer(self, optimizer: Any) -> None:
        target = _unwrap(optimizer)
        for opt in self.trainer.optimizers:
            if opt is target:
                continue
            for group in opt.param_groups:
                for param in group["params"]:
                    if param in self._param_requires_grad_state:
                        param.requires_grad = self._param_requires_grad_state[param]
        self._param_requires_grad_state = {}

    def clip_gradients(
        self,
        optimizer: Any,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> torch.Tensor | None:
        """Clip `optimizer`'s gradients by global norm ("norm", default) or value ("value");
        returns the pre-clip global norm for "norm" (nanolight: Lightning returns None)."""
        return self.trainer.clip_gradients(_unwrap(optimizer), gradient_clip_val, gradient_clip_algorithm)

    # ---- steps (override) --------------------------------------------------------------
    def configure_optimizers(self) -> Any:
        """Return an optimizer, a list of them, ``(optimizers, schedulers)``, or a dict with
        ``optimizer`` and optionally ``lr_scheduler`` (a scheduler or a dict with ``scheduler``,
        ``interval`` ("step"|"epoch"), ``frequency``, ``monitor``)."""
        raise NotImplementedError(f"{type(self).__name__} must implement configure_optimizers()")

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Return the scalar loss of one batch (or a dict with ``"loss"``; None skips the batch)."""
        raise NotImplementedError(f"{type(self).__name__} must implement training_step(batch, batch_idx)")

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """Optional; log metrics with ``self.log`` (epoch means weighted by batch size)."""

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """Optional; as `validation_step`, for ``trainer.test``."""

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        """``trainer.predict`` collects what this returns (default: ``self(batch)``)."""
        return self(batch)

    # ---- checkpoints -------------------------------------------------------------------
    @classmethod
    def load_from_checkpoint(
        cls,
        checkpoint_path: str | Path,
        map_location: Any = None,
        hparams_file: str | Path | None = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> NanoModule:
        """Rebuild the module from a checkpoint directory: ``cls(**saved hparams, **kwargs)``,
        `configure_model`, then the weights (a checkpoint of any parallel layout)."""
        return load_module(cls, checkpoint_path, map_location, hparams_file, strict, kwargs)


def _unwrap(optimizer: Any) -> Any:
    """A `NanoOptimizer`'s wrapped optimizer; anything else as it is."""
    return optimizer.optimizer if isinstance(optimizer, NanoOptimizer) else optimizer


class NanoDataModule(HyperparametersMixin, DataHooks):
    """Override `setup` and the ``*_dataloader`` methods you use."""

    def __init__(self) -> None:
        self.trainer: NanoTrainer | None = None

    def state_dict(self) -> dict[str, Any]:
        """What to save in checkpoints (plain values / tensors)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: str | Path, **kwargs: Any) -> NanoDataModule:
        """``cls(**saved hparams, **kwargs)``, then its saved state."""
        return load_datamodule(cls, checkpoint_path, kwargs)
