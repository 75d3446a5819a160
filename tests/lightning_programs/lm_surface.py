"""The surface a language-model training script uses beyond the loop (issue "Lightning conformance",
item 2), each recorded as its own section of ``observed.json``:

- ``grad_norm``: ``utilities.grad_norm`` called directly (norm types, separator, parameters
  without gradients, ``norm_type=0``) and logged from ``on_before_optimizer_step`` as Lightning's
  docs show.
- ``lambda_callback``: ``LambdaCallback`` with hooks as keyword arguments; an unknown keyword.
- ``timer_step`` / ``timer_epoch`` / ``timer_zero`` / ``timer_resume`` / ``timer_bad``: ``Timer``
  on a fake clock (``time.monotonic`` replaced by a counter the module advances in its steps), so
  every elapsed time and stopping point is deterministic.
- ``throughput``: ``ThroughputMonitor(batch_size_fn, length_fn, window_size)`` on a fake
  ``time.perf_counter``: the keys and values it logs in fit (with validation) and test.
- ``flops``: ``utilities.measure_flops`` of a meta-device model, forward and forward+backward.

Each section runs on its own; an exception is recorded as the section's ``error``.
Run: ``python lm_surface.py OUTDIR``.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import LambdaCallback, ModelCheckpoint, ThroughputMonitor, Timer
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import grad_norm, measure_flops
from observe import write_observed
from torch.utils.data import DataLoader, TensorDataset

QUIET = {
    "accelerator": "cpu",
    "devices": 1,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "logger": False,
}

CLOCK = [1000.0]  # the fake clock's seconds; the module advances it


def fake_clock() -> float:
    return CLOCK[0]


def loader(n: int = 8, seed: int = 0, batch_size: int = 2, width: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, width, generator=g)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=batch_size)


class Net(L.LightningModule):
    """A two-layer regression whose steps advance the fake clock (10 s a training step, 1 s a
    validation step, 2 s a test step)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 3)
        self.head = torch.nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        CLOCK[0] += 10.0
        x, y = batch
        return F.mse_loss(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        CLOCK[0] += 1.0
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        CLOCK[0] += 2.0
        x, y = batch
        self.log("test_loss", F.mse_loss(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


# ---- grad_norm -------------------------------------------------------------------------------
class NormLogger(Net):
    def __init__(self) -> None:
        super().__init__()
        self.head.bias.requires_grad_(False)  # no gradient: no entry

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        norms = grad_norm(self, norm_type=2)
        self.log_dict(norms)
        self.log_dict(grad_norm(self.layer, norm_type="inf", group_separator="."))


def grad_norm_section(outdir: str) -> dict[str, Any]:
    module = Net()
    direct: dict[str, Any] = {"before_backward": grad_norm(module, 2)}
    x, y = next(iter(loader()))
    F.mse_loss(module(x), y).backward()
    for norm_type in (1, 2, 2.5, "inf"):
        direct[str(norm_type)] = {k: float(v) for k, v in grad_norm(module, norm_type).items()}
    direct["separator"] = sorted(grad_norm(module.layer, 2, group_separator="::"))
    try:
        grad_norm(module, 0)
    except ValueError as exc:
        direct["zero"] = str(exc)
    trainer = L.Trainer(
        max_steps=4,
        log_every_n_steps=1,
        default_root_dir=outdir,
        **{**QUIET, "logger": CSVLogger(outdir, name="norms")},
        enable_checkpointing=False,
        limit_val_batches=0,
    )
    trainer.fit(NormLogger(), loader())
    return {"direct": direct, "logged_metrics": dict(sorted(trainer.logged_metrics.items()))}


# ---- lambda_callback -------------------------------------------------------------------------
def lambda_callback(outdir: str) -> dict[str, Any]:
    calls: list[list[Any]] = []

    def rec(name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: calls.append([name, len(args), sorted(kwargs)])

    hooks = [
        "setup",
        "teardown",
        "on_fit_start",
        "on_fit_end",
        "on_sanity_check_start",
        "on_train_start",
        "on_train_epoch_start",
        "on_train_batch_start",
        "on_train_batch_end",
        "on_train_epoch_end",
        "on_validation_epoch_end",
        "on_validation_batch_end",
        "on_before_backward",
        "on_after_backward",
        "on_before_optimizer_step",
        "on_before_zero_grad",
        "on_save_checkpoint",
        "on_train_end",
        "on_test_start",
        "on_test_batch_end",
    ]
    cb = LambdaCallback(**{name: rec(name) for name in hooks})
    trainer = L.Trainer(
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=1,
        num_sanity_val_steps=1,
        default_root_dir=outdir,
        callbacks=[cb],
        **QUIET,
    )
    module = Net()
    trainer.fit(module, loader(), loader(4))
    trainer.test(module, loader(4), verbose=False)
    out: dict[str, Any] = {"calls": calls}
    try:
        LambdaCallback(on_nothing=print)
    except TypeError as exc:
        out["unknown"] = "on_nothing" in str(exc)
    return out


# ---- timer -----------------------------------------------------------------------------------
def timer_report(timer: Timer) -> dict[str, Any]:
    stages = ["train", "sanity_check", "validate", "test", "predict"]
    return {
        "elapsed": {s: timer.time_elapsed(s) for s in stages},
        "start": {s: timer.start_time(s) for s in stages},
        "end": {s: timer.end_time(s) for s in stages},
        "remaining": timer.time_remaining(),
        "state_dict": timer.state_dict(),
    }


def timed_fit(outdir: str, timer: Timer, **kwargs: Any) -> tuple[Any, Net]:
    trainer = L.Trainer(
        default_root_dir=outdir,
        callbacks=[timer, *kwargs.pop("callbacks", [])],
        **{"max_epochs": 4, "limit_val_batches": 2, "num_sanity_val_steps": 0, **kwargs},
        **QUIET,
    )
    return trainer, Net()


def run_timer(outdir: str, timer: Timer, ckpt_path: str | None = None, **kwargs: Any) -> dict[str, Any]:
    time.monotonic = fake_clock
    trainer, module = timed_fit(outdir, timer, **kwargs)
    trainer.fit(module, loader(), loader(4), ckpt_path=ckpt_path)
    return {
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
        "should_stop": trainer.should_stop,
        **timer_report(timer),
    }


def timer_step(outdir: str) -> dict[str, Any]:
    timer = Timer(duration="00:00:00:35", interval="step", verbose=False)
    out = run_timer(outdir, timer)
    L.Trainer(default_root_dir=outdir, callbacks=[timer], **QUIET).test(Net(), loader(4), verbose=False)
    out["after_test"] = timer_report(timer)
    return out


def timer_epoch(outdir: str) -> dict[str, Any]:
    return run_timer(outdir, Timer(duration=dict(seconds=45), interval="epoch"))


def timer_zero(outdir: str) -> dict[str, Any]:
    return run_timer(outdir, Timer(duration=timedelta(0)))


def timer_resume(outdir: str) -> dict[str, Any]:
    def ckpt() -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=os.path.join(outdir, "ckpt"), save_last=True, every_n_train_steps=1)

    first = run_timer(outdir, Timer(duration="00:00:01:00"), max_steps=3, callbacks=[ckpt()])
    resumed = run_timer(outdir, Timer(duration="00:00:01:00"), ckpt_path="last", callbacks=[ckpt()])
    return {"first": first, "resumed": resumed}


def timer_bad(outdir: str) -> dict[str, Any]:
    out = {}
    for name, kwargs in {"duration": {"duration": "1:00"}, "interval": {"interval": "batch"}}.items():
        try:
            Timer(**kwargs)
            out[name] = "accepted"
        except Exception:
            out[name] = "raised"
    out["no_duration"] = Timer().time_remaining()
    return out


# ---- throughput ------------------------------------------------------------------------------
class FlopsNet(Net):
    flops_per_batch = 1000


def throughput(outdir: str) -> dict[str, Any]:
    time.perf_counter = fake_clock
    monitor = ThroughputMonitor(
        batch_size_fn=lambda batch: batch[0].size(0), length_fn=lambda batch: batch[0].numel(), window_size=3
    )
    trainer = L.Trainer(
        max_epochs=2,
        limit_val_batches=3,
        log_every_n_steps=2,
        num_sanity_val_steps=1,
        default_root_dir=outdir,
        callbacks=[monitor],
        **{**QUIET, "logger": CSVLogger(outdir, name="throughput")},
        enable_checkpointing=False,
    )
    module = FlopsNet()
    trainer.fit(module, loader(), loader(6))
    trainer.test(module, loader(8), verbose=False)
    return {"logged_metrics": dict(sorted(trainer.logged_metrics.items()))}


# ---- flops -----------------------------------------------------------------------------------
def flops(outdir: str) -> dict[str, Any]:
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
        x = torch.randn(5, 16)
    return {
        "forward": measure_flops(model, lambda: model(x)),
        "forward_backward": measure_flops(model, lambda: model(x), loss_fn=torch.Tensor.sum),
    }


SECTIONS: list[Callable[[str], dict[str, Any]]] = [
    grad_norm_section,
    lambda_callback,
    timer_step,
    timer_epoch,
    timer_zero,
    timer_resume,
    timer_bad,
    throughput,
    flops,
]


def main(outdir: str) -> None:
    observed: dict[str, Any] = {}
    real_monotonic, real_perf_counter = time.monotonic, time.perf_counter
    for section in SECTIONS:
        L.seed_everything(3)
        CLOCK[0] = 1000.0
        where = os.path.join(outdir, section.__name__)
        os.makedirs(where)
        try:
            observed[section.__name__] = section(where)
        except Exception as exc:  # one section's failure must not hide the others'
            traceback.print_exc()
            observed[section.__name__] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
        finally:
            time.monotonic, time.perf_counter = real_monotonic, real_perf_counter
    write_observed(outdir, observed)


if __name__ == "__main__":
    main(sys.argv[1])
