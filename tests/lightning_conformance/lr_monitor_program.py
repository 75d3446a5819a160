"""The promises of Lightning 2.6.6's ``tests_pytorch/callbacks/test_lr_monitor.py``, as scenarios of ours:
the names ``LearningRateMonitor`` gives optimizers and parameter groups, what it logs with and without
schedulers, momentum and weight decay, and its errors. Each section logs to a CSVLogger (the rows are
part of the record) and records the monitor's ``lrs`` and last momentum / weight-decay values. One
section per promise (see COVERAGE.md); run: ``python lr_monitor_program.py OUTDIR``.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger
from observe import run_sections, to_jsonable
from torch import optim

QUIET = {"enable_progress_bar": False, "enable_model_summary": False, "enable_checkpointing": False}


def _fit(
    outdir: str, model: L.LightningModule, monitor: LearningRateMonitor, **kwargs: Any
) -> dict[str, Any]:
    callbacks = kwargs.pop("callbacks", [])
    trainer = L.Trainer(
        default_root_dir=outdir, callbacks=[monitor, *callbacks], logger=CSVLogger(outdir), **kwargs, **QUIET
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    return {
        "lrs": to_jsonable(monitor.lrs),
        "momentum": to_jsonable(monitor.last_momentum_values),
        "weight_decay": to_jsonable(monitor.last_weight_decay_values),
        "no_momentum_warnings": sum("do not have momentum" in str(w.message) for w in caught),
        "callback_metrics": sorted(k for k in trainer.callback_metrics if "lr-" in k),
        "current_epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
    }


SMALL = {"max_epochs": 2, "limit_val_batches": 0.1, "limit_train_batches": 0.5}
STEPS = {"max_epochs": 2, "limit_val_batches": 2, "limit_train_batches": 5, "log_every_n_steps": 1}


def single_lr(outdir: str) -> dict[str, Any]:
    return _fit(outdir, BoringModel(), LearningRateMonitor(), **SMALL)


class Configured(BoringModel):
    """`configure_optimizers` given as a function of the module."""

    def __init__(self, configure: Any) -> None:
        super().__init__()
        self.configure = configure

    def configure_optimizers(self) -> Any:
        return self.configure(self)


def _momentum_optimizer(name: str, module: torch.nn.Module) -> optim.Optimizer:
    kwargs: dict[str, Any] = {"momentum": 0.9} if name == "SGD" else {"betas": (0.9, 0.999)}
    return getattr(optim, name)(module.parameters(), lr=1e-2, **kwargs)


def single_lr_with_momentum(outdir: str) -> dict[str, Any]:
    out = {}
    for name in ("SGD", "Adam"):

        def configure(m: Any, name: str = name) -> Any:
            opt = _momentum_optimizer(name, m)
            return [opt], [optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10_000)]

        monitor = LearningRateMonitor(log_momentum=True, log_weight_decay=True)
        out[name] = _fit(f"{outdir}/{name}", Configured(configure), monitor, **STEPS)
    return out


def momentum_no_momentum_optimizer(outdir: str) -> dict[str, Any]:
    def configure(m: Any) -> Any:
        opt = optim.ASGD(m.parameters(), lr=1e-2)
        return [opt], [optim.lr_scheduler.StepLR(opt, step_size=1)]

    return _fit(
        outdir, Configured(configure), LearningRateMonitor(log_momentum=True), **{**STEPS, "max_epochs": 1}
    )


def no_lr_scheduler_single_lr(outdir: str) -> dict[str, Any]:
    model = Configured(lambda m: optim.SGD(m.parameters(), lr=0.1))
    return _fit(outdir, model, LearningRateMonitor(), **SMALL)


def no_lr_scheduler_single_lr_with_momentum(outdir: str) -> dict[str, Any]:
    out = {}
    for name in ("SGD", "Adam"):
        model = Configured(lambda m, name=name: [_momentum_optimizer(name, m)])
        out[name] = _fit(f"{outdir}/{name}", model, LearningRateMonitor(log_momentum=True), **STEPS)
    return out


def momentum_no_momentum_optimizer_no_lr_scheduler(outdir: str) -> dict[str, Any]:
    model = Configured(lambda m: [optim.ASGD(m.parameters(), lr=1e-2)])
    return _fit(outdir, model, LearningRateMonitor(log_momentum=True), **{**STEPS, "max_epochs": 1})


def no_logger(outdir: str) -> dict[str, Any]:
    trainer = L.Trainer(
        default_root_dir=outdir, max_epochs=1, callbacks=[LearningRateMonitor()], logger=False
    )
    try:
        trainer.fit(BoringModel())
    except Exception as exc:
        return {"raised": "no logger" in str(exc)}
    return {"raised": False}


class TwoAdams(BoringModel):
    """Manual optimization over two Adams, optionally with a StepLR each stepped at epoch end."""

    def __init__(self, schedulers: bool) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.schedulers = schedulers

    def training_step(self, batch: Any, batch_idx: int) -> None:
        for opt in self.optimizers():
            loss = self.loss(self.step(batch))
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()

    def on_train_epoch_end(self) -> None:
        if self.schedulers:
            for scheduler in self.lr_schedulers():
                scheduler.step()

    def configure_optimizers(self) -> Any:
        opts = [optim.Adam(self.parameters(), lr=1e-2), optim.Adam(self.parameters(), lr=1e-2)]
        if not self.schedulers:
            return opts
        return opts, [optim.lr_scheduler.StepLR(o, 1, gamma=0.1) for o in opts]


def multi_lrs(outdir: str) -> dict[str, Any]:
    out = {}
    for schedulers in (True, False):
        for interval in ("step", "epoch"):
            out[f"{schedulers}-{interval}"] = _fit(
                f"{outdir}/{schedulers}-{interval}",
                TwoAdams(schedulers),
                LearningRateMonitor(logging_interval=interval),
                max_epochs=2,
                log_every_n_steps=2,
                limit_train_batches=7,
                limit_val_batches=0.1,
            )
    return out


def param_groups(outdir: str) -> dict[str, Any]:
    def configure(m: Any) -> Any:
        params = list(m.parameters())
        opt = optim.Adam([{"params": params[:1], "lr": 0.01}, {"params": params[1:], "lr": 0.1}])
        return [opt], [optim.lr_scheduler.StepLR(opt, 1, gamma=0.1)]

    return _fit(outdir, Configured(configure), LearningRateMonitor(), **SMALL)


def custom_name(outdir: str) -> dict[str, Any]:
    def configure(m: Any) -> Any:
        opt = optim.SGD(m.parameters(), lr=0.1)
        return [opt], [{"scheduler": optim.lr_scheduler.StepLR(opt, step_size=1), "name": "my_logging_name"}]

    return _fit(outdir, Configured(configure), LearningRateMonitor(), **SMALL)


def custom_pg_name(outdir: str) -> dict[str, Any]:
    def configure(m: Any) -> Any:
        opt = optim.SGD([{"params": list(m.layer.parameters()), "name": "linear"}], lr=0.1)
        return [opt], [optim.lr_scheduler.StepLR(opt, step_size=1)]

    return _fit(
        outdir,
        Configured(configure),
        LearningRateMonitor(),
        max_epochs=2,
        limit_val_batches=2,
        limit_train_batches=2,
    )


class TwoLinears(BoringModel):
    def __init__(self, configure: Any) -> None:
        super().__init__()
        self.configure = configure
        self.linear_a = torch.nn.Linear(32, 16)
        self.linear_b = torch.nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_b(self.linear_a(x))

    def configure_optimizers(self) -> Any:
        return self.configure(self)


def duplicate_custom_pg_names(outdir: str) -> dict[str, Any]:
    def configure(m: Any) -> Any:
        groups = [
            {"params": list(m.linear_a.parameters()), "name": "linear"},
            {"params": list(m.linear_b.parameters()), "name": "linear"},
        ]
        opt = optim.SGD(groups, lr=0.1)
        return [opt], [optim.lr_scheduler.StepLR(opt, step_size=1)]

    try:
        _fit(
            outdir,
            TwoLinears(configure),
            LearningRateMonitor(),
            max_epochs=2,
            limit_val_batches=2,
            limit_train_batches=2,
        )
    except Exception:  # Lightning: "cannot have multiple parameter groups with identical names"
        return {"raised": True}
    return {"raised": False}


def multiple_param_groups_no_lr_scheduler(outdir: str) -> dict[str, Any]:
    def configure(m: Any) -> Any:
        groups = [
            {"params": list(m.linear_a.parameters()), "weight_decay": 0.1},
            {"params": list(m.linear_b.parameters()), "weight_decay": 0.1},
        ]
        return torch.optim.Adam(groups, lr=1e-2, betas=(0.7, 0.999))

    monitor = LearningRateMonitor(log_momentum=True, log_weight_decay=True)
    return _fit(
        outdir, TwoLinears(configure), monitor, max_epochs=2, limit_val_batches=2, limit_train_batches=2
    )


def update_callback_metrics(outdir: str) -> dict[str, Any]:
    def configure(m: Any) -> Any:
        opt = torch.optim.SGD(m.layer.parameters(), lr=0.1)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]

    early = EarlyStopping(
        monitor="lr-SGD", mode="min", stopping_threshold=0.02, check_on_train_epoch_end=True
    )
    out = _fit(
        outdir,
        Configured(configure),
        LearningRateMonitor(),
        callbacks=[early],
        max_epochs=5,
        limit_val_batches=0,
        limit_train_batches=2,
    )
    return {**out, "stopped_epoch": early.stopped_epoch}


def float64_lr(outdir: str) -> dict[str, Any]:
    model = Configured(lambda m: optim.SGD(m.parameters(), lr=np.float64(0.01)))
    out = _fit(outdir, model, LearningRateMonitor(), max_epochs=1, limit_train_batches=2, limit_val_batches=0)
    return {**out, "lrs": {k: [float(v) for v in vs] for k, vs in out["lrs"].items()}}


SECTIONS = [
    single_lr,
    single_lr_with_momentum,
    momentum_no_momentum_optimizer,
    no_lr_scheduler_single_lr,
    no_lr_scheduler_single_lr_with_momentum,
    momentum_no_momentum_optimizer_no_lr_scheduler,
    no_logger,
    multi_lrs,
    param_groups,
    custom_name,
    custom_pg_name,
    duplicate_custom_pg_names,
    multiple_param_groups_no_lr_scheduler,
    update_callback_metrics,
    float64_lr,
]

if __name__ == "__main__":
    run_sections(sys.argv[1], SECTIONS, L.seed_everything)
