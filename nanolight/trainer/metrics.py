"""What ``self.log`` records and when it reaches the trainer's metric dicts and the loggers
(Lightning's logger connector and result collection, in one place).

Recording: each call goes to the loop's `Results` (training, or the evaluation pass running),
with Lightning's defaults for the hook it is called from (``on_step`` in training steps and
batch hooks, ``on_epoch`` elsewhere) and the batch size inferred for epoch means. A step value is
the *last* one logged (with accumulation: the last micro-batch's) and stays until the loop
resets; an epoch value is the batch-size-weighted mean, or the sum / max / min. ``sync_dist``
values are reduced through `Strategy.reduce`, all of a step's (or an epoch's) in one collective.
Names follow Lightning: ``name_step`` / ``name_epoch`` when logged both ways, and
``/dataloader_idx_<i>`` with several evaluation dataloaders.

Publishing: values reach ``callback_metrics`` / ``progress_bar_metrics`` / ``logged_metrics``
after every batch (step values) and when an epoch ends -- before the epoch-end hooks, so a
callback's ``on_validation_epoch_end`` sees this pass's values (and, at a train epoch's end, again
before the monitoring callbacks, which see what the module logged in ``on_train_epoch_end``).

Rows for the loggers, at Lightning's ``step``: a training row after each optimizer step when due
(`NanoTrainer.should_log`), at ``log_step`` (``global_step - 1``; under manual optimization once
per batch); an evaluation row at the end of every validation/test pass (not the sanity check) at
the current ``log_step``; the train epoch row at the epoch's last step (``log_step - 1``, after
the epoch's validation row). Every row gets ``epoch`` unless the caller names its own step.
Converting values to floats syncs the device, so it happens only for rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from nanolight.errors import UsageError

if TYPE_CHECKING:
    from nanolight.trainer.trainer import NanoTrainer

# hooks whose logs default to step values (Lightning's FxValidator); every other allowed hook
# defaults to epoch values
STEP_HOOKS = frozenset(
    """training_step on_train_batch_start on_train_batch_end on_before_backward backward
    on_after_backward on_before_optimizer_step optimizer_step on_before_zero_grad
    optimizer_zero_grad configure_gradient_clipping lr_scheduler_step""".split()
)
DATALOADER_SUFFIX = "/dataloader_idx_"  # added to names logged while one of several loaders runs
NOT_LOGGABLE = frozenset(
    """predict_step on_predict_start on_predict_end on_predict_epoch_start on_predict_epoch_end
    on_predict_batch_start on_predict_batch_end setup teardown prepare_data configure_model
    configure_optimizers configure_callbacks on_fit_start on_fit_end on_sanity_check_start
    on_sanity_check_end on_train_end train_dataloader val_dataloader test_dataloader
    predict_dataloader on_save_checkpoint on_load_checkpoint on_validation_end on_test_end
    on_validation_model_zero_grad on_validation_model_eval on_test_model_eval
    on_validation_model_train on_test_model_train on_before_batch_transfer transfer_batch_to_device
    on_after_batch_transfer lr_scheduler_step on_exception state_dict load_state_dict""".split()
)


def batch_size_of(batch: Any) -> int | None:
    """The first tensor's leading size in a (nested) batch, as Lightning infers it."""
    if isinstance(batch, torch.Tensor):
        return 1 if batch.dim() == 0 else int(batch.size(0))
    if isinstance(batch, str):
        return None
    items: Iterable[Any] = batch.values() if isinstance(batch, Mapping) else batch if _iterable(batch) else ()
    for item in items:
        size = batch_size_of(item)
        if size is not None:
            return size
    return None


def _iterable(obj: Any) -> bool:
    return isinstance(obj, (list, tuple)) or (hasattr(obj, "__iter__") and hasattr(obj, "__len__"))


class MetricStore:
    """The trainer's logging state and its rows (the trainer's ``metrics`` part)."""

    def __init__(self, trainer: NanoTrainer) -> None:
        self.trainer = trainer
        self.always_sync = False  # the strategy's `parallel.metrics_always_sync`, set when a call starts
        self.train = Results(training=True)
        self.eval = Results(training=False)
        self.active: Results | None = None
        self.hook: str | None = None  # the hook running now (sets the defaults)
        self.batch: Any = None  # the batch being processed (for its size)
        self.dataloader_idx: int | None = None  # evaluation with several dataloaders
        self.reset()

    def reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        # a collective: every rank of the strategy's dp group exchanges these values (under
        # pipeline parallelism the last stage's), all of a step's or an epoch's in one call
        return self.trainer.strategy.reduce(tensor, op)

    def log(
        self,
        name: str,
        value: Any,
        *,
        prog_bar: bool,
        logger: bool,
        on_step: bool | None,
        on_epoch: bool | None,
        reduce_fx: Any,
        sync_dist: bool,
        batch_size: int | None,
        add_dataloader_idx: bool,
    ) -> None:
        hook = self.hook or "training_step"
        if hook in NOT_LOGGABLE or self.active is None:
            raise UsageError(f"self.log({name!r}) cannot be called in {hook}: log in a step or a loop hook")
        default_step = hook in STEP_HOOKS
        on_step = default_step if on_step is None else on_step
        on_epoch = (not default_step) if on_epoch is None else on_epoch
        if not self.active.training and on_step and hook in ("on_validation_epoch_end", "on_test_epoch_end"):
            raise UsageError(
                f"self.log({name!r}, on_step=True) in {hook}: an epoch-end hook logs epoch values"
            )
        if not (on_step or on_epoch):
            raise UsageError(f"self.log({name!r}, on_step=False, on_epoch=False) would record nothing")
        if DATALOADER_SUFFIX in name:
            raise UsageError(
                f"self.log({name!r}): {DATALOADER_SUFFIX}N is the suffix the trainer adds for several "
                "dataloaders; use another name (and add_dataloader_idx=False to log per loader yourself)"
            )
        if self.dataloader_idx is not None and add_dataloader_idx:
            name = f"{name}{DATALOADER_SUFFIX}{self.dataloader_idx}"
        fx = reduce_fx_name(reduce_fx)
        meta = Meta(name, prog_bar, logger, on_step, on_epoch, fx, sync_dist or self.always_sync)
        tensor = to_scalar_tensor(name, value)
        if batch_size is None:
            batch_size = (batch_size_of(self.batch) or 1) if fx == "mean" and on_epoch else 1
        self.active.log(meta, tensor, batch_size, self.dataloader_idx, hook)
        if on_step and self.active.training:  # seen at once by later hooks of this batch (unsynced)
            self.callback_metrics[name] = tensor
            self.callback_metrics[meta.forked(True)] = tensor
        elif on_epoch and hook in ("on_train_epoch_end", "on_validation_epoch_end", "on_test_epoch_end"):
            self.callback_metrics[name] = tensor  # seen at once by the callbacks after this one (Lightning)

    # ---- publishing (Lightning's on_batch_end / on_epoch_end) -----------------------------
    def publish(self, results: Results, on_step: bool, update: bool = True) -> dict[str, torch.Tensor]:
        """Update callback / progress-bar / logged metrics (unless not `update`); returns the values
        for a logger row."""
        if on_step:
            results.sync_step(self.reduce)
        else:
            results.compute_epoch(self.reduce)
        log, callback, pbar = results.values(on_step, self.dataloader_idx)
        if not update:
            return log
        self.callback_metrics.update(callback)
        self.progress_bar_metrics.update(pbar)
        self.logged_metrics.update(log)
        return log

    def publish_step(self, sync: bool) -> dict[str, torch.Tensor]:
        """A training batch ended: its step values reach callback/logged metrics (`sync`: the
        ``sync_dist`` ones reduced first, one collective)."""
        if sync:
            return self.publish(self.train, on_step=True)
        log, callback, pbar = self.train.values(on_step=True)
        self.callback_metrics.update(callback)
        self.progress_bar_metrics.update(pbar)
        return log

    def reset(self) -> None:
        """A new trainer call: Lightning's dicts start empty for fit, validate, test, predict."""
        self.train.reset()
        self.eval.reset()
        self.callback_metrics: dict[str, torch.Tensor] = {}
        self.logged_metrics: dict[str, torch.Tensor] = {}
        self.progress_bar_metrics: dict[str, torch.Tensor] = {}
        self._eval_rows: dict[int, int] = {}  # per-batch evaluation rows written, per dataloader

    # ---- rows for the loggers ------------------------------------------------------------
    def log_row(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """`NanoTrainer.log_metrics`: `metrics` (floats or scalar tensors) to every logger (global
        rank zero writes). Without `step`: the current `log_step`, and an ``epoch`` column."""
        trainer = self.trainer
        if not trainer.loggers or not metrics:
            return
        self.logged_metrics.update(metrics)
        scalars = {k: float(v) if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}
        if step is None:
            scalars.setdefault("epoch", trainer.current_epoch)
            step = trainer.log_step
        if trainer.is_global_zero:
            for lg in trainer.loggers:
                lg.log_metrics(dict(scalars), step)
                lg.save()

    def step_row(self) -> None:
        """An optimizer step ended: its values published, its row written when due."""
        log = self.publish_step(sync=True)
        if self.trainer.should_log or self.trainer.config.fast_dev_run:
            self.log_row(dict(log))

    def epoch_row(self) -> None:
        """The train epoch ended (its hooks ran): the epoch row, at the last step's index."""
        log = self.publish(self.train, on_step=False)  # + what the hooks logged
        if log:
            progress = self.trainer.progress
            progress["stepped"] -= 1  # Lightning writes the epoch row at the last step's index
            try:
                self.log_row(dict(log))
            finally:
                progress["stepped"] += 1
        self.train.reset()

    def eval_batch_row(self, metrics: dict[str, Any], dataloader_idx: int) -> None:
        """An evaluation batch's on_step values: one row per batch, its step the batches this
        dataloader has seen in this call."""
        n = self._eval_rows.get(dataloader_idx, 0)
        self._eval_rows[dataloader_idx] = n + 1
        self.log_row(metrics, step=n)


Reduce = Callable[[torch.Tensor, str], torch.Tensor]
REDUCE_FX = ("mean", "sum", "max", "min")


@dataclass(frozen=True)
class Meta:
    name: str  # with the dataloader suffix, if any
    prog_bar: bool
    logger: bool
    on_step: bool
    on_epoch: bool
    reduce_fx: str
    sync: bool

    def forked(self, on_step: bool) -> str:
        """``name_step`` / ``name_epoch`` when logged as both; the dataloader suffix stays last
        (``loss_epoch/dataloader_idx_0``, Lightning's)."""
        if self.on_step and self.on_epoch:
            base, sep, idx = self.name.partition(DATALOADER_SUFFIX)
            return f"{base}_{'step' if on_step else 'epoch'}{sep}{idx}"
        return self.name


class _Metric:
    def __init__(self, meta: Meta) -> None:
        self.meta = meta
        self.last: torch.Tensor | None = None  # the step value
        self.last_synced = False
        self.acc: torch.Tensor | None = None  # sum(value * batch size) / sum / max / min
        self.weight: torch.Tensor | None = None  # sum of batch sizes (mean)
        self.epoch: torch.Tensor | None = None  # computed epoch value (cached until a new log)
        self.dataloader_idx: int | None = None  # the evaluation dataloader that logged it (several)

    def update(self, value: torch.Tensor, batch_size: int) -> None:
        fx = self.meta.reduce_fx
        self.last, self.last_synced, self.epoch = value, False, None
        if not self.meta.on_epoch:
            return
        if fx == "mean":
            # filled on the value's device: torch.tensor(..., device=cuda) would copy from the host and sync
            term, size = value * batch_size, torch.full((), float(batch_size), device=value.device)
            self.acc = term if self.acc is None else self.acc + term
            self.weight = size if self.weight is None else self.weight + size
        elif self.acc is None:
            self.acc = value.clone()
        elif fx == "sum":
            self.acc = self.acc + value
        else:
            self.acc = torch.maximum(self.acc, value) if fx == "max" else torch.minimum(self.acc, value)


def to_scalar_tensor(name: str, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise UsageError(f"self.log({name!r}) needs a scalar, got a tensor of shape {tuple(value.shape)}")
        value = value.detach().reshape(())
        return value if value.is_floating_point() else value.float()
    if isinstance(value, (bool, int, float)):
        return torch.tensor(float(value))
    raise UsageError(f"self.log({name!r}) needs a number or a scalar tensor, got {type(value).__name__}")


def reduce_fx_name(fx: Any) -> str:
    """A reduction by name, as Lightning reads it: any case, ``avg`` for mean, torch's or Python's functions."""
    name = fx.lower() if isinstance(fx, str) else getattr(fx, "__name__", repr(fx))
    name = {"amax": "max", "amin": "min", "avg": "mean"}.get(name, name)
    if name not in REDUCE_FX:
        raise UsageError(f"self.log(reduce_fx={fx!r}): use one of {REDUCE_FX} (or torch.mean/sum/max/min)")
    return name


class Results:
    """One loop's logged metrics. `training` decides which names reach ``callback_metrics``."""

    def __init__(self, training: bool) -> None:
        self.training = training
        self.metrics: dict[tuple[str, str], _Metric] = {}  # by (hook, name)

    def log(
        self,
        meta: Meta,
        value: torch.Tensor,
        batch_size: int,
        dataloader_idx: int | None = None,
        hook: str = "training_step",
    ) -> None:
        """Record a value. A metric is a name *in a hook* (Lightning's ``"{fx}.{name}"``): the same
        name logged from two hooks is two metrics, and the later-logged one's values win."""
        metric = self.metrics.get((hook, meta.name))
        if metric is None or metric.meta != meta:
            if metric is not None and metric.last is not None:
                raise UsageError(
                    f"self.log({meta.name!r}) was called with different arguments in {hook} "
                    f"(before: {_args(metric.meta)}, now: {_args(meta)}); log each name one way"
                )
            metric = self.metrics[hook, meta.name] = _Metric(meta)
        metric.update(value, batch_size)
        metric.dataloader_idx = dataloader_idx

    def sync_step(self, reduce: Reduce) -> None:
        """Reduce the unsynced ``sync_dist`` step values over ranks, in one collective."""
        todo = [m for m in self.metrics.values() if m.meta.sync and m.meta.on_step and not m.last_synced]
        for m, value in _reduced(reduce, todo, REDUCE_FX, "last"):
            m.last, m.last_synced = value, True

    def compute_epoch(self, reduce: Reduce) -> None:
        """Epoch values of the on_epoch metrics not computed yet (``sync_dist`` ones in one
        collective per reduction kind)."""
        todo = [m for m in self.metrics.values() if m.meta.on_epoch and m.epoch is None and m.acc is not None]
        local = [m for m in todo if not m.meta.sync]
        for m in local:
            m.epoch = m.acc / m.weight if m.meta.reduce_fx == "mean" else m.acc  # type: ignore[operator]
        synced = [m for m in todo if m.meta.sync]
        means = [m for m in synced if m.meta.reduce_fx == "mean"]
        if means:  # the global weighted mean: sums of value*size and of sizes, over ranks
            flat = reduce(torch.stack([t for m in means for t in (m.acc, m.weight)]).float(), "sum")
            for k, m in enumerate(means):
                m.epoch = flat[2 * k] / flat[2 * k + 1]
        for m, value in _reduced(reduce, synced, ("sum", "max", "min"), "acc"):
            m.epoch = value

    def values(
        self, on_step: bool, dataloader_idx: int | None = None
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(for the loggers, for callback_metrics, for the progress bar), as Lightning's
        ``_ResultCollection.metrics``: step values when `on_step` (only `dataloader_idx`'s while
        one of several evaluation loaders runs), else epoch values."""
        log: dict[str, torch.Tensor] = {}
        callback: dict[str, torch.Tensor] = {}
        pbar: dict[str, torch.Tensor] = {}
        for m in self.metrics.values():
            other_loader = (
                None not in (dataloader_idx, m.dataloader_idx) and m.dataloader_idx != dataloader_idx
            )
            value = m.last if on_step and m.meta.on_step and not other_loader else None
            if not on_step and m.meta.on_epoch:
                value = m.epoch
            if value is None:
                continue
            forked = m.meta.forked(on_step)
            if m.meta.logger:
                log[forked] = value
            # an epoch value is a callback metric while its own loader's (or, unsplit, the epoch's) are read
            if self.training or (m.meta.on_epoch and not on_step and m.dataloader_idx == dataloader_idx):
                callback[m.meta.name] = value
                callback[forked] = value
            if m.meta.prog_bar:
                pbar[forked] = value
        return log, callback, pbar

    def reset(self) -> None:
        self.metrics = {}


def _reduced(
    reduce: Reduce, metrics: list[_Metric], ops: tuple[str, ...], field: str
) -> Iterator[tuple[_Metric, torch.Tensor]]:
    """Each metric's `field` reduced over ranks: one collective per reduction kind in `ops`."""
    for op in ops:
        group = [m for m in metrics if m.meta.reduce_fx == op]
        if group:
            out = reduce(torch.stack([getattr(m, field).float() for m in group]), op)
            yield from zip(group, out.unbind(), strict=True)


def _args(meta: Meta) -> str:
    return (
        f"on_step={meta.on_step}, on_epoch={meta.on_epoch}, reduce_fx={meta.reduce_fx!r}, "
        f"sync_dist={meta.sync}, prog_bar={meta.prog_bar}, logger={meta.logger}"
    )
