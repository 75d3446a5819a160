"""The promises of Lightning 2.6.6's ``tests_pytorch/checkpointing/test_model_checkpoint.py``, as scenarios
of ours: which checkpoints ``ModelCheckpoint`` keeps (files by stem), what it selects (best / k-th /
last paths relative to the section, scores), its names and its argument checks. nanolight's ``last``
pointer is left out of a listing unless ``save_last`` asked for a last checkpoint (README: a checkpoint
is a directory and ``last`` always names the newest). One section per promise (see COVERAGE.md); run:
``python model_checkpoint_program.py OUTDIR``.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from datetime import timedelta
from typing import Any

import lightning as L
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger
from observe import listing, raises, relative, run_sections, selection
from torch import optim

QUIET = {"enable_progress_bar": False, "enable_model_summary": False, "logger": False}
CLOCK = [0.0]


def files_of(cb: ModelCheckpoint) -> list[str]:
    return selection(cb, cb.dirpath or ".")["files"]


def _fit(outdir: str, model: L.LightningModule, cb: ModelCheckpoint | None, **kwargs: Any) -> L.Trainer:
    callbacks = [] if cb is None else [cb]
    trainer = L.Trainer(default_root_dir=outdir, callbacks=callbacks, **{**QUIET, **kwargs})
    trainer.fit(model)
    return trainer


class LogInTwoMethods(BoringModel):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        self.log("early_stop_on", out["loss"])
        return out

    def on_validation_epoch_end(self) -> None:
        self.log("val_acc", torch.tensor(1.23))


def state_key(outdir: str) -> dict[str, Any]:
    return {"state_key": ModelCheckpoint(monitor="val_loss").state_key}


class ScoredModel(BoringModel):
    def __init__(self, monitor: str, plateau: bool, no_validation: bool, epochs: int = 3) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.train_logs = torch.randn(epochs, 12, generator=g)
        self.val_logs = torch.randn(epochs * 4, 7, generator=g)
        self.monitor, self.plateau, self.val_count = monitor, plateau, 0
        if no_validation:
            self.validation_step = None

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.log("train_log", self.train_logs[self.current_epoch, batch_idx], on_epoch=True)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        self.log("val_log", self.val_logs[self.val_count, batch_idx])
        return super().validation_step(batch, batch_idx)

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking:
            self.val_count += 1

    def configure_optimizers(self) -> Any:
        opt = optim.SGD(self.parameters(), lr=0.1)
        if self.plateau:
            return [opt], [{"scheduler": optim.lr_scheduler.ReduceLROnPlateau(opt), "monitor": self.monitor}]
        return [opt], [optim.lr_scheduler.StepLR(opt, step_size=1, gamma=2)]


def score_and_ckpt(outdir: str) -> dict[str, Any]:
    out = {}
    for no_val, monitor in ((False, "val_log"), (True, "train_log_epoch")):
        for plateau in (False, True):
            where = os.path.join(outdir, f"{monitor}-{plateau}")
            cb = ModelCheckpoint(
                dirpath=where, filename="{" + monitor + ":.4f}-{epoch}", monitor=monitor, save_top_k=-1
            )
            _fit(
                where,
                ScoredModel(monitor, plateau, no_val),
                cb,
                limit_train_batches=5,
                limit_val_batches=7,
                max_epochs=3,
            )
            out[f"{monitor}-{plateau}"] = selection(cb, where)
    return out


def score_and_ckpt_val_check_interval(outdir: str) -> dict[str, Any]:
    out = {}
    for interval, plateau in ((0.25, True), (0.25, False), (0.42, False)):
        where = os.path.join(outdir, f"{interval}-{plateau}")
        cb = ModelCheckpoint(
            dirpath=where, filename="{val_log:.4f}-{epoch}", monitor="val_log", save_top_k=-1
        )
        model = ScoredModel("val_log", plateau, False)
        kwargs = {
            "limit_train_batches": 12,
            "limit_val_batches": 7,
            "max_epochs": 3,
            "num_sanity_val_steps": 0,
        }
        trainer = _fit(where, model, cb, val_check_interval=interval, **kwargs)
        out[f"{interval}-{plateau}"] = {**selection(cb, where), "global_step": trainer.global_step}
    return out


def with_non_string_input(outdir: str) -> dict[str, Any]:
    out = {}
    for k in (-1, 0, 1, 2):
        where = os.path.join(outdir, str(k))
        cb = ModelCheckpoint(monitor="early_stop_on", dirpath=None, filename="{epoch}", save_top_k=k)
        _fit(where, LogInTwoMethods(), cb, limit_train_batches=0.2, limit_val_batches=0.2, max_epochs=2)
        out[str(k)] = {"dirpath": relative(cb.dirpath, where), **selection(cb, where)}
    return out


def to_yaml(outdir: str) -> dict[str, Any]:
    out = {}
    for k in (-1, 0, 1, 2):
        where = os.path.join(outdir, str(k))
        cb = ModelCheckpoint(dirpath=where, monitor="early_stop_on", save_top_k=k)
        _fit(where, LogInTwoMethods(), cb, limit_train_batches=0.2, limit_val_batches=0.2, max_epochs=2)
        path = os.path.join(outdir, f"best_k_models_{k}.yaml")
        cb.to_yaml(path)
        with open(path) as f:
            saved = yaml.full_load(f)
        os.remove(path)
        out[str(k)] = {relative(p, where): round(float(v), 5) for p, v in saved.items()}
    return out


def model_checkpoint_path(outdir: str) -> dict[str, Any]:
    out = {}
    for version in (None, 1, "awesome"):
        where = os.path.join(outdir, str(version))
        trainer = L.Trainer(
            default_root_dir=where,
            limit_train_batches=2,
            limit_val_batches=2,
            max_epochs=2,
            logger=CSVLogger(where, version=version),
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(LogInTwoMethods())
        out[str(version)] = relative(trainer.checkpoint_callback.dirpath, where)
    return out


def pickling(outdir: str) -> dict[str, Any]:
    cb = ModelCheckpoint(dirpath=outdir, monitor="foo", save_top_k=2)
    loaded = pickle.loads(pickle.dumps(cb))
    return {"same": [relative(loaded.dirpath, outdir), loaded.monitor, loaded.save_top_k]}


class Join(ModelCheckpoint):
    CHECKPOINT_JOIN_CHAR = "@"


class Equals(ModelCheckpoint):
    CHECKPOINT_EQUALS_CHAR = ":"


def format_checkpoint_name(outdir: str) -> dict[str, Any]:
    def name(cb: ModelCheckpoint, metrics: dict[str, Any], **kwargs: Any) -> str | None:
        return relative(cb.format_checkpoint_name(metrics, **kwargs), outdir)

    d = outdir
    return {
        "default": name(ModelCheckpoint(dirpath=d), {"epoch": 3, "step": 2}),
        "prefix": name(ModelCheckpoint(dirpath=d), {"epoch": 3, "step": 2}, prefix="test"),
        "plain": name(ModelCheckpoint(dirpath=d, filename="ckpt"), {}, prefix="test"),
        "padded": name(ModelCheckpoint(dirpath=d, filename="{epoch:03d}-{acc}"), {"epoch": 3, "acc": 0.03}),
        "prefix_of": name(
            ModelCheckpoint(dirpath=d, filename="{epoch:03d}-{epoch_test:03d}"), {"epoch": 3, "epoch_test": 3}
        ),
        "join": name(Join(dirpath=d, filename="{epoch},{acc:.5f}"), {"epoch": 3, "acc": 0.03}, prefix="test"),
        "equals": name(Equals(dirpath=d, filename="{epoch:03d}-{acc}"), {"epoch": 3, "acc": 0.03}),
        "version": name(ModelCheckpoint(dirpath=d, filename="name"), {}, ver=3),
        "no_insert": name(
            ModelCheckpoint(
                dirpath=d, filename="epoch={epoch:03d}-val_acc={val/acc}", auto_insert_metric_name=False
            ),
            {"epoch": 3, "val/acc": 0.03},
        ),
        "at_sign": name(
            ModelCheckpoint(dirpath=d, filename="mAP@0.50={val/mAP@0.50:.4f}", auto_insert_metric_name=False),
            {"val/mAP@0.50": 0.2},
        ),
    }


class Extension(ModelCheckpoint):
    FILE_EXTENSION = ".tpkc"


def file_extension(outdir: str) -> dict[str, Any]:
    cb = Extension(monitor="early_stop_on", dirpath=outdir, save_top_k=1, save_last=True)
    _fit(outdir, LogInTwoMethods(), cb, max_steps=1)
    return {"files": [n for n in listing(outdir) if not n.startswith("last")]}  # `last`: a pointer (README)


def save_last(outdir: str) -> dict[str, Any]:
    out = {}
    for mode in (True, "link"):
        where = os.path.join(outdir, str(mode))
        cb = ModelCheckpoint(monitor="early_stop_on", dirpath=where, save_top_k=-1, save_last=mode)
        _fit(where, LogInTwoMethods(), cb, max_epochs=3, limit_train_batches=10, limit_val_batches=10)
        out[str(mode)] = selection(cb, where)
    return out


def argument_checks(outdir: str) -> dict[str, Any]:
    d = outdir
    return {
        "top_k_-3": raises(lambda: ModelCheckpoint(dirpath=d, save_top_k=-3)),
        "none_monitor_top_k": [
            raises(lambda k=k: ModelCheckpoint(dirpath=d, save_top_k=k)) for k in (3, -1, 0, 1)
        ],
        "every_n_epochs": [
            raises(lambda n=n: ModelCheckpoint(dirpath=d, every_n_epochs=n)) for n in (-3, 0, 1, 2)
        ],
        "every_n_train_steps": [
            raises(lambda n=n: ModelCheckpoint(dirpath=d, every_n_train_steps=n)) for n in (-3, 0, 1)
        ],
        "combinations": [
            raises(lambda kw=kw: ModelCheckpoint(dirpath=d, **kw))
            for kw in (
                {"every_n_train_steps": 1, "every_n_epochs": 2},
                {"train_time_interval": timedelta(minutes=1), "every_n_epochs": 2},
                {"train_time_interval": timedelta(minutes=1), "every_n_train_steps": 2},
                {"every_n_train_steps": 0, "every_n_epochs": 3},
                {"every_n_train_steps": 4, "every_n_epochs": 0},
                {"every_n_train_steps": 0, "every_n_epochs": 0, "train_time_interval": timedelta(minutes=1)},
            )
        ],
        "defaults": [ModelCheckpoint(dirpath=d).every_n_epochs],
        "mode": raises(lambda: ModelCheckpoint(mode="unknown_option")),
    }


class ListDir(BoringModel):
    def __init__(self, where: str) -> None:
        super().__init__()
        self.where, self.seen = where, []

    def on_train_epoch_start(self) -> None:
        self.seen.append(listing(self.where))


def none_monitor_not_alternating(outdir: str) -> dict[str, Any]:
    model = ListDir(outdir)
    cb = ModelCheckpoint(dirpath=outdir, monitor=None, save_top_k=1, filename="model")
    _fit(outdir, model, cb, limit_train_batches=1, limit_val_batches=0, max_epochs=3)
    return {"seen": [[n for n in s if n != "last"] for s in model.seen]}


def save_last_none_monitor(outdir: str) -> dict[str, Any]:
    cb = ModelCheckpoint(monitor=None, dirpath=outdir, save_top_k=-1, save_last=True)
    _fit(outdir, LogInTwoMethods(), cb, limit_train_batches=10, limit_val_batches=10, max_epochs=2)
    return selection(cb, outdir)


def every_n_epochs(outdir: str) -> dict[str, Any]:
    out = {}
    for n in range(4):
        where = os.path.join(outdir, str(n))
        cb = ModelCheckpoint(dirpath=where, filename="{epoch}", save_top_k=-1, every_n_epochs=n)
        _fit(where, LogInTwoMethods(), cb, max_epochs=5, limit_train_batches=1, limit_val_batches=1)
        out[str(n)] = files_of(cb)
    return out


def every_n_train_steps(outdir: str) -> dict[str, Any]:
    cb = ModelCheckpoint(
        filename="{step}",
        every_n_epochs=0,
        every_n_train_steps=4,
        dirpath=outdir,
        save_top_k=-1,
        save_last=False,
    )
    _fit(outdir, LogInTwoMethods(), cb, max_epochs=2, limit_train_batches=16, limit_val_batches=2)
    return {"files": listing(outdir)}


class ClockModel(BoringModel):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        CLOCK[0] += 10.0
        return super().training_step(batch, batch_idx)


def train_time_interval(outdir: str) -> dict[str, Any]:
    time.monotonic = lambda: CLOCK[0]
    cb = ModelCheckpoint(dirpath=outdir, save_top_k=-1, train_time_interval=timedelta(seconds=25))
    _fit(outdir, ClockModel(), cb, max_epochs=2, limit_train_batches=7, limit_val_batches=0)
    return {"files": files_of(cb)}


def _last_only(cb: ModelCheckpoint, outdir: str) -> dict[str, Any]:
    """Only a last checkpoint: Lightning writes last.ckpt alone, nanolight the step's directory that
    `last` names (README), so the listing is left out."""
    state = selection(cb, outdir)
    return {**{k: v for k, v in state.items() if k != "files"}, "has_last": "last" in state["files"]}


def topk_zero(outdir: str) -> dict[str, Any]:
    cb = ModelCheckpoint(dirpath=outdir, save_top_k=0, save_last=True)
    _fit(outdir, BoringModel(), cb, max_epochs=2, limit_train_batches=2, limit_val_batches=2)
    return {**_last_only(cb, outdir), "monitor": cb.monitor}


def topk_all(outdir: str) -> dict[str, Any]:
    cb = ModelCheckpoint(dirpath=outdir, monitor="epoch", mode="max", save_top_k=-1, filename="{epoch}")
    _fit(outdir, BoringModel(), cb, max_epochs=3, limit_train_batches=2, limit_val_batches=2)
    return selection(cb, outdir)


def ckpt_metric_names(outdir: str) -> dict[str, Any]:
    cb = ModelCheckpoint(monitor="early_stop_on", dirpath=outdir, filename="{val_loss:.2f}")
    model = LogInTwoMethods()
    model.validation_step = lambda batch, batch_idx: model.log("val_loss", 0.123456)  # type: ignore[method-assign]
    _fit(outdir, model, cb, max_epochs=1, limit_train_batches=2, limit_val_batches=2)
    return selection(cb, outdir)


def default_checkpoint_behavior(outdir: str) -> dict[str, Any]:
    trainer = L.Trainer(
        default_root_dir=outdir, max_epochs=3, limit_train_batches=5, limit_val_batches=5, **QUIET
    )
    model = LogInTwoMethods()
    trainer.fit(model)
    results = trainer.test(model, verbose=False)
    cb = trainer.checkpoint_callback
    return {"tests": len(results), "dirpath": relative(cb.dirpath, outdir), **selection(cb, outdir)}


def configure_model_checkpoint(outdir: str) -> dict[str, Any]:
    a, b = ModelCheckpoint(monitor="foo"), ModelCheckpoint(monitor="bar")
    kw = {"default_root_dir": outdir, **QUIET}
    off = L.Trainer(enable_checkpointing=False, callbacks=[], **kw)
    default = L.Trainer(callbacks=[], **kw)
    one = L.Trainer(enable_checkpointing=True, callbacks=[a], **kw)
    two = L.Trainer(callbacks=[a, b], **kw)
    return {
        "off": [sum(isinstance(c, ModelCheckpoint) for c in off.callbacks), off.checkpoint_callback is None],
        "default": [sum(isinstance(c, ModelCheckpoint) for c in default.callbacks)],
        "one": [
            [c is a for c in one.callbacks if isinstance(c, ModelCheckpoint)],
            one.checkpoint_callback is a,
        ],
        "two": [
            two.checkpoint_callback is a,
            [c is x for c, x in zip(two.checkpoint_callbacks, (a, b), strict=True)],
        ],
        "conflict": raises(lambda: L.Trainer(enable_checkpointing=False, callbacks=[a], **kw)),
    }


def val_check_interval_checkpoint_files(outdir: str) -> dict[str, Any]:
    cb = ModelCheckpoint(dirpath=outdir, save_top_k=-1, monitor="val_acc", mode="max")
    _fit(
        outdir,
        LogInTwoMethods(),
        cb,
        val_check_interval=0.2,
        max_epochs=1,
        limit_train_batches=10,
        limit_val_batches=2,
    )
    return selection(cb, outdir)


def check_val_every_n_epochs_top_k(outdir: str) -> dict[str, Any]:
    cb = ModelCheckpoint(dirpath=outdir, monitor="epoch", save_top_k=-1, filename="{epoch}")
    _fit(
        outdir,
        BoringModel(),
        cb,
        max_epochs=5,
        check_val_every_n_epoch=2,
        limit_train_batches=1,
        limit_val_batches=1,
        num_sanity_val_steps=0,
    )
    return {"files": files_of(cb)}


SECTIONS = [
    state_key,
    score_and_ckpt,
    score_and_ckpt_val_check_interval,
    with_non_string_input,
    to_yaml,
    model_checkpoint_path,
    pickling,
    format_checkpoint_name,
    file_extension,
    save_last,
    argument_checks,
    none_monitor_not_alternating,
    save_last_none_monitor,
    every_n_epochs,
    every_n_train_steps,
    train_time_interval,
    topk_zero,
    topk_all,
    ckpt_metric_names,
    default_checkpoint_behavior,
    configure_model_checkpoint,
    val_check_interval_checkpoint_files,
    check_val_every_n_epochs_top_k,
]

REAL_MONOTONIC = time.monotonic


def seed(value: int) -> None:
    time.monotonic = REAL_MONOTONIC  # train_time_interval installs a fake clock for its section only
    CLOCK[0] = 0.0
    L.seed_everything(value)


if __name__ == "__main__":
    run_sections(sys.argv[1], SECTIONS, seed)
