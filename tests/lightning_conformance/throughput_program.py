"""The promises of Lightning 2.6.6's ``tests_pytorch/callbacks/test_throughput_monitor.py``, as scenarios of
ours, on a fake ``time.perf_counter`` the module advances (1 s a training step, 0.5 s a validation step,
2 s a test step, 3 s a predict step), so every time and rate is exact. Each section logs to its own
CSVLogger: the rows are the record. One section per promise (see COVERAGE.md); run:
``python throughput_program.py OUTDIR``.
"""

from __future__ import annotations

import sys
import time
import warnings
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import measure_flops
from observe import run_sections
from torch.utils.data import DataLoader

QUIET = {"enable_progress_bar": False, "enable_model_summary": False, "enable_checkpointing": False}
CLOCK = [100.0]


def fake_clock() -> float:
    return CLOCK[0]


class ClockModel(BoringModel):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        CLOCK[0] += 1.0
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        CLOCK[0] += 0.5
        return super().validation_step(batch, batch_idx)

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        CLOCK[0] += 2.0
        return super().test_step(batch, batch_idx)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        CLOCK[0] += 3.0
        return super().predict_step(batch, batch_idx, dataloader_idx)


def _model(flops: int | None = 10) -> ClockModel:
    model = ClockModel()
    if flops is not None:
        model.flops_per_batch = flops
    return model


def _fit(outdir: str, monitor: ThroughputMonitor, model: BoringModel, *args: Any, **kwargs: Any) -> dict:
    trainer = L.Trainer(
        default_root_dir=outdir, logger=CSVLogger(outdir), callbacks=monitor, **kwargs, **QUIET
    )
    trainer.fit(model, *args)
    return {"global_step": trainer.global_step}


def measure_flops_section(outdir: str) -> dict[str, Any]:
    with torch.device("meta"):
        model = BoringModel()
        x = torch.randn(2, 32)
    forward = measure_flops(model, lambda: model(x))
    both = measure_flops(model, lambda: model(x), model.loss)
    return {
        "forward": forward,
        "forward_backward": both,
        "types": [type(forward).__name__, type(both).__name__],
    }


def fit(outdir: str) -> dict[str, Any]:
    monitor = ThroughputMonitor(
        length_fn=lambda x: 3 * 2, batch_size_fn=lambda x: 3, window_size=4, separator="|"
    )
    return _fit(outdir, monitor, _model(), max_steps=5, log_every_n_steps=1, limit_val_batches=0)


def fit_with_validation(outdir: str) -> dict[str, Any]:
    monitor = ThroughputMonitor(batch_size_fn=lambda x: 1, window_size=2)
    return _fit(
        outdir,
        monitor,
        _model(None),
        max_steps=2,
        val_check_interval=1,
        log_every_n_steps=1,
        limit_val_batches=1,
        num_sanity_val_steps=2,
    )


def fit_no_length_fn(outdir: str) -> dict[str, Any]:
    monitor = ThroughputMonitor(batch_size_fn=lambda x: 3, window_size=2)
    return _fit(outdir, monitor, _model(33), max_steps=3, log_every_n_steps=1, limit_val_batches=0)


def fit_gradient_accumulation(outdir: str) -> dict[str, Any]:
    out = {}
    for every in (1, 3):
        monitor = ThroughputMonitor(
            length_fn=lambda x: 6, batch_size_fn=lambda x: 3, window_size=4, separator="|"
        )
        out[str(every)] = _fit(
            f"{outdir}/every_{every}",
            monitor,
            _model(),
            limit_train_batches=5,
            limit_val_batches=0,
            max_epochs=2,
            log_every_n_steps=every,
            accumulate_grad_batches=2,
        )
    return out


def evaluation(outdir: str) -> dict[str, Any]:
    out = {}
    for fn in ("validate", "test", "predict"):
        monitor = ThroughputMonitor(batch_size_fn=lambda x: 3, window_size=3, separator="|")
        trainer = L.Trainer(
            default_root_dir=outdir,
            logger=CSVLogger(outdir, name=fn),
            callbacks=monitor,
            limit_val_batches=6,
            limit_test_batches=6,
            limit_predict_batches=6,
            log_every_n_steps=3,
            **QUIET,
        )
        model = _model()
        getattr(trainer, fn)(model, **({} if fn == "predict" else {"verbose": False}))
        getattr(trainer, fn)(model, **({} if fn == "predict" else {"verbose": False}))
        out[fn] = {"logged_metrics": {k: float(v) for k, v in sorted(trainer.logged_metrics.items())}}
    return out


def _sized_loader(sizes: list[int]) -> DataLoader:
    """Batches of the given sizes, in order."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    batches = [list(range(s, s + n)) for s, n in zip(starts, sizes, strict=True)]
    return DataLoader(RandomDataset(32, sum(sizes)), batch_sampler=batches)


def variable_batch_size(outdir: str) -> dict[str, Any]:
    monitor = ThroughputMonitor(batch_size_fn=lambda b: b.size(0), window_size=5, separator="|")
    sizes = [1, 3, 2, 1, 4]
    return _fit(
        outdir,
        monitor,
        _model(),
        _sized_loader(sizes),
        max_steps=len(sizes),
        log_every_n_steps=1,
        limit_val_batches=0,
    )


def variable_batch_size_with_validation(outdir: str) -> dict[str, Any]:
    monitor = ThroughputMonitor(batch_size_fn=lambda b: b.size(0), window_size=3)
    return _fit(
        outdir,
        monitor,
        _model(None),
        _sized_loader([2, 1, 3]),
        _sized_loader([1, 2]),
        max_steps=3,
        log_every_n_steps=1,
        limit_val_batches=2,
        val_check_interval=2,
        num_sanity_val_steps=0,
    )


def validation_with_many_epochs(outdir: str) -> dict[str, Any]:
    monitor = ThroughputMonitor(batch_size_fn=lambda x: 1)
    return _fit(
        outdir,
        monitor,
        _model(),
        max_epochs=12,
        limit_train_batches=2,
        limit_val_batches=1,
        log_every_n_steps=1,
    )


def warn_once(outdir: str) -> dict[str, Any]:
    monitor = ThroughputMonitor(batch_size_fn=lambda x: 1)
    trainer = L.Trainer(
        default_root_dir=outdir, logger=False, max_epochs=1, limit_train_batches=2, callbacks=monitor, **QUIET
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_model(None))
    return {"flops_warnings": sum("flops_per_batch" in str(w.message) for w in caught)}


SECTIONS = [
    measure_flops_section,
    fit,
    fit_with_validation,
    fit_no_length_fn,
    fit_gradient_accumulation,
    evaluation,
    variable_batch_size,
    variable_batch_size_with_validation,
    validation_with_many_epochs,
    warn_once,
]


def seed_and_clock(seed: int) -> None:
    """Each section starts on the fake clock at 100 s (installed for the whole program)."""
    time.perf_counter = fake_clock
    CLOCK[0] = 100.0
    L.seed_everything(seed)


if __name__ == "__main__":
    run_sections(sys.argv[1], SECTIONS, seed_and_clock)
