"""What Lightning 2.6's ``tests_pytorch/trainer/logging_/*`` promise about ``self.log``, as
scenarios of our own: which keys reach ``callback_metrics`` / ``logged_metrics`` /
``progress_bar_metrics`` (and their types) from training, validation and test steps, epoch-end
hooks and callbacks; reductions, batch sizes, dataloader suffixes, what is reset when; the rows a
logger receives. One section per promise (``run_sections``). Run: ``python logging_program.py OUTDIR``.
"""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset, RandomDictDataset
from lightning.pytorch.loggers import CSVLogger
from observe import read_csv_logs, run_sections
from torch.utils.data import DataLoader

QUIET = {"accelerator": "cpu", "devices": 1, "enable_progress_bar": False, "enable_model_summary": False}


def dicts(trainer: Any) -> dict[str, Any]:
    """The three metric dicts, values as floats, and the types the framework keeps them as."""

    def values(d: dict[str, Any]) -> dict[str, float]:
        return {k: float(v) for k, v in sorted(d.items())}

    return {
        "callback": values(trainer.callback_metrics),
        "logged": values(trainer.logged_metrics),
        "pbar": values(trainer.progress_bar_metrics),
        "types": sorted(
            {
                f"{name}:{type(v).__name__}"
                for name, d in (
                    ("callback", trainer.callback_metrics),
                    ("logged", trainer.logged_metrics),
                    ("pbar", trainer.progress_bar_metrics),
                )
                for v in d.values()
            }
        ),
    }


def fit(model: Any, outdir: str, **kwargs: Any) -> L.Trainer:
    options = {"logger": CSVLogger(outdir), **QUIET, **kwargs}
    trainer = L.Trainer(default_root_dir=outdir, **options)
    trainer.fit(model)
    return trainer


def rows(outdir: str) -> Any:
    return read_csv_logs(Path(outdir))[0]


def outcome(run: Any) -> str:
    try:
        run()
    except Exception:
        return "raised"
    return "ran"


# ---- test_train_loop_logging.py -----------------------------------------------------------------
def training_step_log(outdir: str) -> dict[str, Any]:
    class Model(BoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = super().training_step(batch, batch_idx)["loss"]
            self.log("default", loss)
            self.log("l_s", loss, on_step=True, on_epoch=False, prog_bar=False, logger=True)
            self.log("l_e", loss, on_step=False, on_epoch=True, prog_bar=False, logger=True)
            self.log("l_se", loss, on_step=True, on_epoch=True, prog_bar=False, logger=True)
            self.log("p_s", loss, on_step=True, on_epoch=False, prog_bar=True, logger=False)
            self.log("p_e", loss, on_step=False, on_epoch=True, prog_bar=True, logger=False)
            self.log("p_se", loss, on_step=True, on_epoch=True, prog_bar=True, logger=False)
            return loss

    model = Model()
    model.val_dataloader = None
    t = fit(
        model,
        outdir,
        limit_train_batches=2,
        limit_val_batches=2,
        max_epochs=2,
        log_every_n_steps=1,
        callbacks=[ModelCheckpoint(monitor="l_se")],
    )
    return {**dicts(t), "rows": rows(outdir)}


def training_epoch_end_log(outdir: str) -> dict[str, Any]:
    class Model(BoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            out = super().training_step(batch, batch_idx)
            self.log("a", out["loss"], on_step=True, on_epoch=True)
            self.log_dict({"a1": out["loss"], "a2": out["loss"]})
            return out

        def on_train_epoch_end(self) -> None:
            self.log("b1", torch.tensor(1.0))
            self.log("b", torch.tensor(2.0), on_epoch=True, prog_bar=True, logger=True)

    model = Model()
    model.val_dataloader = None
    t = fit(model, outdir, limit_train_batches=2, limit_val_batches=2, max_epochs=2, log_every_n_steps=1)
    return {**dicts(t), "rows": rows(outdir)}


def reduce_fx(outdir: str) -> dict[str, Any]:
    out = {}
    for batches, fx, name in (
        (3, min, "min"),
        (3, torch.max, "torch.max"),
        (11, max, "max"),
        (5, "avg", "avg"),
        (5, "SUM", "SUM"),
    ):

        class Model(BoringModel):
            def training_step(self, batch: Any, batch_idx: int, fx: Any = fx) -> Any:
                self.log(
                    "foo",
                    torch.tensor(batch_idx, dtype=torch.long),
                    on_step=False,
                    on_epoch=True,
                    reduce_fx=fx,
                )
                return super().training_step(batch, batch_idx)

            def validation_step(self, batch: Any, batch_idx: int, fx: Any = fx) -> Any:
                self.log("bar", torch.tensor(batch_idx).float(), on_step=False, on_epoch=True, reduce_fx=fx)
                return super().validation_step(batch, batch_idx)

        where = os.path.join(outdir, name)
        try:
            t = fit(Model(), where, limit_train_batches=batches, limit_val_batches=batches, max_epochs=2)
            out[name] = [float(t.logged_metrics["foo"]), float(t.logged_metrics["bar"])]
        except Exception:
            out[name] = "raised"
    return out


def dict_batches(outdir: str) -> dict[str, Any]:
    class Model(BoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            self.log("a", 2, on_step=True, on_epoch=True)
            return self.step(batch["a"])

        def validation_step(self, batch: Any, batch_idx: int) -> Any:
            self.log("n", 3, on_step=True, on_epoch=True)
            return {"x": self.step(batch["a"])}

        def train_dataloader(self) -> DataLoader:
            return DataLoader(RandomDictDataset(32, 64), batch_size=32)

        def val_dataloader(self) -> DataLoader:
            return DataLoader(RandomDictDataset(32, 64), batch_size=32)

    return dicts(
        fit(Model(), outdir, limit_train_batches=1, limit_val_batches=2, max_epochs=1, fast_dev_run=True)
    )


class FlagLogger(L.Callback):
    """Logs a distinct count from every hook with each combination of on_step/on_epoch/prog_bar."""

    def __init__(self, hooks: dict[str, bool]) -> None:
        self.count = 0
        self.calls: dict[str, int] = {}
        self.refused: list[str] = []
        for hook, step_allowed in hooks.items():
            setattr(self, hook, self._maker(hook, step_allowed))

    def _maker(self, hook: str, step_allowed: bool) -> Any:
        def run(trainer: Any, module: Any, *args: Any) -> None:
            self.calls[hook] = self.calls.get(hook, 0) + 1
            steps = (False, True) if step_allowed else (False,)
            for idx, (on_step, on_epoch, prog_bar) in enumerate(
                itertools.product(steps, (False, True) if step_allowed else (True,), (False, True))
            ):
                name = f"{hook}_{idx}"
                if not on_step and not on_epoch:
                    try:
                        module.log(name, self.count, on_step=on_step, on_epoch=on_epoch)
                    except Exception:
                        self.refused.append(name)
                    continue
                module.log(name, self.count, on_step=on_step, on_epoch=on_epoch, prog_bar=prog_bar)
                self.count += 1

        return run


def log_in_train_callback(outdir: str) -> dict[str, Any]:
    class Model(BoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = super().training_step(batch, batch_idx)["loss"]
            self.log("train_loss", loss, prog_bar=True)
            return {"loss": loss}

    cb = FlagLogger(
        {
            "on_train_start": False,
            "on_train_epoch_start": False,
            "on_train_batch_start": True,
            "on_train_batch_end": True,
            "on_train_epoch_end": False,
        }
    )
    t = fit(
        Model(),
        outdir,
        limit_train_batches=2,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        max_epochs=1,
        callbacks=[cb],
    )
    return {**dicts(t), "calls": cb.calls, "refused": cb.refused}


def sync_dist_one_process(outdir: str) -> dict[str, Any]:
    class Model(BoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            value = 1 + self.trainer.global_rank
            for name, v, step, fx in (
                ("foo", value, True, "sum"),
                ("foo_2", 2, True, "sum"),
                ("foo_3", 2, True, "mean"),
                ("foo_4", value, True, "mean"),
                ("foo_5", batch_idx, True, "max"),
                ("foo_6", value, False, "sum"),
                ("foo_7", 2, False, "sum"),
                ("foo_8", 2, False, "mean"),
                ("foo_9", value, False, "mean"),
                ("foo_10", batch_idx, False, "max"),
            ):
                self.log(name, v, on_step=step, on_epoch=not step, sync_dist=True, reduce_fx=fx)
            self.log("foo_11", batch_idx, on_step=True, on_epoch=True, sync_dist=True, reduce_fx="mean")
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch: Any, batch_idx: int) -> Any:
            self.log("bar", 1, on_step=False, on_epoch=True, sync_dist=True, reduce_fx="sum")
            self.log("bar_2", 1, on_step=False, on_epoch=True, sync_dist=True, reduce_fx="mean")
            self.log("bar_3", batch_idx, on_step=False, on_epoch=True, sync_dist=True, reduce_fx="max")
            return super().validation_step(batch, batch_idx)

    return dicts(fit(Model(), outdir, max_epochs=1, limit_train_batches=3, limit_val_batches=3))


def progress_bar_at_train_end(outdir: str) -> dict[str, Any]:
    seen: list[Any] = []

    class Model(BoringModel):
        def training_step(self, *args: Any) -> Any:
            self.log("foo", torch.tensor(self.current_epoch), on_step=False, on_epoch=True, prog_bar=True)
            return super().training_step(*args)

        def on_train_epoch_end(self) -> None:
            self.log(
                "foo_2",
                torch.tensor(self.current_epoch),
                prog_bar=True,
                on_epoch=True,
                sync_dist=True,
                reduce_fx="sum",
            )

        def on_train_end(self) -> None:
            seen.append({k: float(v) for k, v in sorted(self.trainer.progress_bar_metrics.items())})

    fit(
        Model(),
        outdir,
        max_epochs=2,
        limit_train_batches=1,
        limit_val_batches=0,
        enable_checkpointing=False,
        logger=False,
    )
    return {"at_train_end": seen}


def callback_self_log(outdir: str) -> dict[str, Any]:
    class Logging(L.Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            module.log("on_train_start", 1)

        def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
            module.log("on_train_epoch_start", 2)

        def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
            module.log("on_train_batch_end", 3)

        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            module.log("on_train_epoch_end", 5)

    return dicts(
        fit(
            BoringModel(),
            outdir,
            limit_train_batches=1,
            limit_val_batches=1,
            max_epochs=1,
            callbacks=[Logging()],
        )
    )


def metric_reduced_for_callbacks(outdir: str) -> dict[str, Any]:
    class Model(BoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            out = super().training_step(batch, batch_idx)
            self.log("train_loss", out["loss"])
            return out

        def validation_step(self, batch: Any, batch_idx: int) -> Any:
            self.log("val_acc", float(batch_idx < 8), on_step=True, on_epoch=True)
            return super().validation_step(batch, batch_idx)

    early = EarlyStopping(monitor="val_acc", mode="max")
    ckpt = ModelCheckpoint(monitor="val_acc", save_last=True, save_top_k=2, mode="max")
    t = fit(
        Model(), outdir, max_epochs=2, limit_train_batches=5, limit_val_batches=32, callbacks=[early, ckpt]
    )
    return {
        "val_acc": float(t.callback_metrics["val_acc"]),
        "has_train_loss": "train_loss" in t.callback_metrics,
        "best": float(ckpt.best_model_score),
    }


def log_invalid_values(outdir: str) -> dict[str, Any]:
    out = {}
    for name, value in (
        ("none", None),
        ("dict_none", {"a": None}),
        ("dict", {"a": 1}),
        ("nested", {"a": {"b": 1}}),
        ("str", "foo"),
        ("list", [1, 2, 3]),
        ("tuple", (1, 2, 3)),
        ("ragged", [[1, 2], 3]),
        ("vector", torch.tensor([1.0, 2.0])),
        ("one_element", torch.tensor([1.2])),
    ):

        class Model(BoringModel):
            def training_step(self, batch: Any, batch_idx: int, value: Any = value) -> Any:
                self.log("foo", value)
                return super().training_step(batch, batch_idx)

        t = L.Trainer(default_root_dir=outdir, fast_dev_run=1, logger=False, **QUIET)
        out[name] = outcome(lambda t=t: t.fit(Model()))
        if name == "one_element" and out[name] == "ran":
            out["one_element_ndim"] = t.callback_metrics["foo"].ndim
    return out


def log_misuse_raises(outdir: str) -> dict[str, Any]:
    def run(step: Any) -> str:
        class Model(BoringModel):
            def training_step(self, batch: Any, batch_idx: int) -> Any:
                step(self)
                return super().training_step(batch, batch_idx)

        t = L.Trainer(
            default_root_dir=outdir,
            limit_train_batches=1,
            limit_val_batches=0,
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            **QUIET,
        )
        return outcome(lambda: t.fit(Model()))

    return {
        "reserved_suffix": run(lambda m: m.log("foo/dataloader_idx_0", -1)),
        "twice_different_args": run(
            lambda m: (m.log("foo", -1, prog_bar=False), m.log("foo", -1, prog_bar=True))
        ),
        "argmax_reduce": run(lambda m: m.log("foo", -1, reduce_fx=torch.argmax)),
        "neither_step_nor_epoch": run(lambda m: m.log("foo", -1, on_step=False, on_epoch=False)),
        "twice_same_args": run(lambda m: (m.log("foo", -1), m.log("foo", -2))),
    }


def sanity_metrics_reset(outdir: str) -> dict[str, Any]:
    seen: list[Any] = []

    class Model(BoringModel):
        def validation_step(self, batch: Any, batch_idx: int) -> Any:
            out = super().validation_step(batch, batch_idx)
            if self.trainer.sanity_checking:
                self.log("val_loss", out["x"], prog_bar=True, logger=True)
            return out

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = super().training_step(batch, batch_idx)["loss"]
            if batch_idx == 0:
                seen.append(
                    [
                        len(self.trainer.progress_bar_metrics),
                        len(self.trainer.logged_metrics),
                        len(self.trainer.callback_metrics),
                    ]
                )
            self.log("train_loss", loss, prog_bar=True, logger=True)
            return loss

    t = fit(Model(), outdir, max_epochs=1, limit_train_batches=1, limit_val_batches=2, num_sanity_val_steps=2)
    return {"at_first_step": seen, **dicts(t)}


def sum_on_batch_hooks(outdir: str) -> dict[str, Any]:
    seen: list[Any] = []

    class Model(BoringModel):
        def on_train_epoch_end(self) -> None:
            self.log("on_train_epoch_end", 3.0, reduce_fx="mean")
            seen.append(["train", {k: float(v) for k, v in sorted(self.trainer.callback_metrics.items())}])

        def on_validation_epoch_end(self) -> None:
            self.log("on_validation_epoch_end", 3.0, reduce_fx="mean")
            seen.append(["val", {k: float(v) for k, v in sorted(self.trainer.callback_metrics.items())}])

        def on_train_batch_start(self, *_: Any) -> None:
            self.log("on_train_batch_start", 1.0, on_step=False, on_epoch=True, reduce_fx="sum")

        def on_train_batch_end(self, *_: Any) -> None:
            self.log("on_train_batch_end", 1.0, on_step=False, on_epoch=True, reduce_fx="sum")

        def on_validation_batch_start(self, *_: Any) -> None:
            self.log("on_validation_batch_start", 1.0, reduce_fx="sum")

        def on_validation_batch_end(self, *_: Any) -> None:
            self.log("on_validation_batch_end", 1.0, reduce_fx="sum")

    model = Model()
    t = L.Trainer(
        default_root_dir=outdir,
        limit_train_batches=3,
        limit_val_batches=3,
        num_sanity_val_steps=3,
        max_epochs=1,
        logger=False,
        **QUIET,
    )
    t.fit(
        model,
        DataLoader(RandomDataset(32, 64), batch_size=2),
        DataLoader(RandomDataset(32, 64), batch_size=2),
    )
    return {"seen": seen, **dicts(t)}


def epoch_and_step_rows(outdir: str) -> dict[str, Any]:
    class Model(BoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            self.log("foo", 0.0, on_step=True, on_epoch=True)
            return super().training_step(batch, batch_idx)

    fit(
        Model(),
        outdir,
        limit_train_batches=2,
        limit_val_batches=0,
        max_epochs=2,
        log_every_n_steps=1,
        enable_checkpointing=False,
    )
    return {"rows": rows(outdir)}


def log_on_train_start(outdir: str) -> dict[str, Any]:
    class Model(BoringModel):
        def on_train_start(self) -> None:
            self.log("foo", 123)

    t = fit(
        Model(),
        outdir,
        limit_train_batches=1,
        limit_val_batches=0,
        max_epochs=2,
        log_every_n_steps=1,
        enable_checkpointing=False,
    )
    return {"rows": rows(outdir), "max_epochs": t.max_epochs}


# ---- test_eval_loop_logging.py ------------------------------------------------------------------
def validation_step_log(outdir: str) -> dict[str, Any]:
    class Model(BoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            out = super().training_step(batch, batch_idx)
            self.log("a", out["loss"], on_step=True, on_epoch=True)
            self.log("a2", 2)
            return out

        def validation_step(self, batch: Any, batch_idx: int) -> Any:
            out = super().validation_step(batch, batch_idx)
            self.log("b", out["x"], on_step=True, on_epoch=True)
            return out

    t = fit(Model(), outdir, limit_train_batches=2, limit_val_batches=2, max_epochs=2, log_every_n_steps=1)
    return {**dicts(t), "rows": rows(outdir)}


def validation_epoch_end_log(outdir: str) -> dict[str, Any]:
    class Model(BoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            out = super().training_step(batch, batch_idx)
            self.log("a", out["loss"])
            self.log("b", out["loss"], on_step=True, on_epoch=True)
            return out

        def validation_step(self, batch: Any, batch_idx: int) -> Any:
            out = super().validation_step(batch, batch_idx)
            self.log("c", out["x"])
            self.log("d", out["x"], on_step=True, on_epoch=True)
            return out

        def on_validation_epoch_end(self) -> None:
            self.log("g", torch.tensor(2, device=self.device), on_epoch=True)

    t = fit(Model(), outdir, limit_train_batches=2, limit_val_batches=2, max_epochs=2, log_every_n_steps=1)
    return {**dicts(t), "rows": rows(outdir)}


def eval_epoch_logging(outdir: str) -> dict[str, Any]:
    out = {}
    for batches, interval, epochs in ((1, 1, 1), (64, 32, 2)):

        class Model(BoringModel):
            def on_validation_epoch_end(self) -> None:
                self.log("c", torch.tensor(2), on_epoch=True, prog_bar=True, logger=True)
                self.log("d/e/f", 2)

        where = os.path.join(outdir, str(batches))
        t = fit(
            Model(),
            where,
            limit_train_batches=batches,
            limit_val_batches=batches,
            max_epochs=epochs,
            log_every_n_steps=interval,
        )
        out[str(batches)] = {**dicts(t), "rows": rows(where)}
    return out


def eval_float_and_auto_reduce(outdir: str) -> dict[str, Any]:
    losses: list[float] = []

    class Model(BoringModel):
        def validation_step(self, batch: Any, batch_idx: int) -> Any:
            loss = self.step(batch)
            losses.append(float(loss))
            self.log("a", 12.0)
            self.log("val_loss", loss, on_epoch=True, on_step=True, prog_bar=True)
            return {"x": loss}

    t = fit(
        Model(),
        outdir,
        limit_train_batches=3,
        limit_val_batches=3,
        max_epochs=1,
        log_every_n_steps=1,
        num_sanity_val_steps=0,
    )
    return {**dicts(t), "losses": losses}


def test_epoch_only_logging(outdir: str) -> dict[str, Any]:
    out = {}
    for batches in (1, 64):

        class Model(BoringModel):
            def on_test_epoch_end(self) -> None:
                self.log("c", torch.tensor(2))
                self.log("d/e/f", 2)

        t = L.Trainer(default_root_dir=outdir, limit_test_batches=batches, logger=False, **QUIET)
        out[str(batches)] = t.test(Model(), verbose=False)
    return out


def multi_dataloader_suffix(outdir: str) -> dict[str, Any]:
    out = {}
    for suffix in (False, True):

        class Model(BoringModel):
            def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
                out = super().test_step(batch, batch_idx)
                self.log("test_loss", out["y"], on_step=True, on_epoch=True)
                return out

            def test_dataloader(self, suffix: bool = suffix) -> Any:
                if suffix:
                    return [DataLoader(RandomDataset(32, 64)), DataLoader(RandomDataset(32, 64))]
                return super().test_dataloader()

        t = L.Trainer(default_root_dir=outdir, limit_test_batches=2, logger=False, **QUIET)
        out[str(suffix)] = [sorted(r) for r in t.test(Model(), verbose=False)]
    return out


def log_in_eval_callbacks(outdir: str) -> dict[str, Any]:
    val_hooks = {
        "on_validation_start": False,
        "on_validation_epoch_start": False,
        "on_validation_batch_start": False,
        "on_validation_batch_end": False,
        "on_validation_epoch_end": False,
    }
    test_hooks = {k.replace("validation", "test"): v for k, v in val_hooks.items()}
    out = {}
    for name, hooks in (("validate", val_hooks), ("test", test_hooks)):
        cb = FlagLogger(hooks)
        t = L.Trainer(
            default_root_dir=outdir,
            limit_train_batches=1,
            limit_val_batches=4,
            limit_test_batches=2,
            max_epochs=1,
            num_sanity_val_steps=0,
            logger=False,
            callbacks=[cb],
            **QUIET,
        )
        results = getattr(t, name)(BoringModel(), verbose=False)
        out[name] = {**dicts(t), "calls": cb.calls, "refused": cb.refused, "results": results}
    return out


def multiple_dataloaders_reset(outdir: str) -> dict[str, Any]:
    out = {}
    for interval in (0.5, 1.0):
        seen: list[Any] = []

        class Model(BoringModel):
            def training_step(self, batch: Any, batch_idx: int) -> Any:
                value = (1 + batch_idx) * (10 if self.current_epoch else 1)
                self.log("batch_idx", value, on_step=True, on_epoch=True, prog_bar=True)
                return super().training_step(batch, batch_idx)

            def on_train_epoch_end(self, seen: list[Any] = seen) -> None:
                seen.append(float(self.trainer.progress_bar_metrics["batch_idx_epoch"]))

            def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int) -> None:
                value = (1 + batch_idx) * (1 + dataloader_idx) * (10 if self.current_epoch else 1)
                self.log("val_loss", value, on_step=False, on_epoch=True, prog_bar=True, logger=True)

            def val_dataloader(self) -> Any:
                return [super().val_dataloader(), super().val_dataloader()]

        where = os.path.join(outdir, str(interval))
        t = fit(
            Model(),
            where,
            limit_train_batches=5,
            limit_val_batches=5,
            num_sanity_val_steps=0,
            val_check_interval=interval,
            max_epochs=3,
            log_every_n_steps=1,
        )
        out[str(interval)] = {"seen": seen, **dicts(t), "rows": rows(where)}
    return out


def no_dataloader_idx(outdir: str) -> list[Any]:
    class Model(BoringModel):
        def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int) -> None:
            self.log_dict({"test_log_common": 789})
            self.log("test_log_common_diff_value", dataloader_idx + 1)
            self.log(
                f"test_log_no_dl_idx_{dataloader_idx}", 321 * (dataloader_idx + 1), add_dataloader_idx=False
            )
            self.log_dict(
                {"test_log_a_class": 123} if dataloader_idx == 0 else {"test_log_b_class": 456},
                add_dataloader_idx=False,
            )

        def test_dataloader(self) -> Any:
            return [DataLoader(RandomDataset(32, 64)) for _ in range(2)]

    return L.Trainer(default_root_dir=outdir, fast_dev_run=1, logger=False, **QUIET).test(
        Model(), verbose=False
    )


def multi_dataloader_epoch_end(outdir: str) -> dict[str, Any]:
    class Model(BoringModel):
        def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int) -> Any:
            self.log("foo", dataloader_idx + 1)
            return dataloader_idx + 1

        def on_test_epoch_end(self) -> None:
            self.log("foobar", 3)

        def test_dataloader(self) -> Any:
            return [super().test_dataloader(), super().test_dataloader()]

    t = L.Trainer(default_root_dir=outdir, limit_test_batches=1, logger=CSVLogger(outdir), **QUIET)
    results = t.test(Model(), verbose=False)
    return {"results": results, **dicts(t), "rows": rows(outdir)}


def eval_step_rows(outdir: str) -> dict[str, Any]:
    out = {}
    for loaders in (1, 2):

        class Model(BoringModel):
            def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
                self.log("v", float(batch_idx + 10 * dataloader_idx), on_step=True, on_epoch=False)
                return super().validation_step(batch, batch_idx)

            def val_dataloader(self, loaders: int = loaders) -> Any:
                return (
                    [BoringModel.val_dataloader(self) for _ in range(loaders)]
                    if loaders > 1
                    else super().val_dataloader()
                )

        where = os.path.join(outdir, str(loaders))
        t = L.Trainer(default_root_dir=where, limit_val_batches=3, logger=CSVLogger(where), **QUIET)
        t.validate(Model(), verbose=False)
        out[str(loaders)] = {"rows": rows(where), **dicts(t)}
    return out


# ---- test_logger_connector.py / test_loop_logging.py / test_distributed_logging.py ---------------
def where_log_is_allowed(outdir: str) -> dict[str, Any]:
    """self.log from every hook: refused where Lightning refuses it; the default on_step/on_epoch."""
    hooks = [
        "on_fit_start", "on_train_start", "on_train_epoch_start", "on_train_batch_start", "on_before_backward",
        "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad", "on_train_batch_end",
        "on_train_epoch_end", "on_validation_start", "on_validation_epoch_start", "on_validation_batch_start",
        "on_validation_batch_end", "on_validation_epoch_end", "on_validation_end", "on_train_end", "on_fit_end",
        "on_sanity_check_start", "on_sanity_check_end", "setup", "teardown", "configure_optimizers",
        "on_validation_model_eval", "on_validation_model_train", "on_save_checkpoint",
    ]  # fmt: skip
    module_hooks = {h for h in hooks if not h.startswith("on_sanity")}
    result: dict[str, Any] = {}

    def attempt(module: Any, hook: str, who: str) -> None:
        key = f"{who}.{hook}"
        if key in result:
            return
        try:
            module.log(f"{who}_{hook}", 1.0)
            result[key] = "ok"
        except Exception:
            result[key] = "raised"

    class Everywhere(L.Callback):
        pass

    for hook in hooks:
        setattr(
            Everywhere, hook, lambda self, trainer, module, *a, hook=hook, **k: attempt(module, hook, "cb")
        )

    class Model(BoringModel):
        pass

    for hook in module_hooks:
        original = getattr(BoringModel, hook)

        def wrapper(self: Any, *a: Any, hook: str = hook, original: Any = original, **k: Any) -> Any:
            attempt(self, hook, "module")
            return original(self, *a, **k)

        setattr(Model, hook, wrapper)
    t = fit(
        Model(), outdir, max_epochs=1, limit_train_batches=2, limit_val_batches=1, callbacks=[Everywhere()]
    )
    logged = {k: float(v) for k, v in sorted(t.logged_metrics.items())}
    return {
        "result": dict(sorted(result.items())),
        "logged": sorted(logged),
        "callback": sorted(t.callback_metrics),
    }


def auto_add_dataloader_idx(outdir: str) -> dict[str, Any]:
    out = {}
    for add in (False, True):

        class Model(BoringModel):
            def validation_step(
                self, batch: Any, batch_idx: int, dataloader_idx: int = 0, add: bool = add
            ) -> Any:
                out = super().validation_step(batch, batch_idx)
                name = "val_loss" if add else f"val_loss_custom_naming_{dataloader_idx}"
                self.log(name, out["x"], on_step=True, add_dataloader_idx=add)
                return out

            def val_dataloader(self) -> Any:
                return [super().val_dataloader(), super().val_dataloader()]

        t = fit(
            Model(), os.path.join(outdir, str(add)), max_epochs=1, limit_train_batches=2, limit_val_batches=2
        )
        out[str(add)] = sorted(t.logged_metrics)
    return out


def metrics_reset_per_stage(outdir: str) -> dict[str, Any]:
    snapshots = {}
    model = BoringModel()

    class Model(BoringModel):
        def _log(self, stage: str, batch: Any) -> Any:
            loss = self.step(batch)
            self.log(f"{stage}_loss", loss, on_step=True, on_epoch=True)
            return loss

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return {"loss": self._log("train", batch)}

        def validation_step(self, batch: Any, batch_idx: int) -> Any:
            self._log("val", batch)

        def test_step(self, batch: Any, batch_idx: int) -> Any:
            self._log("test", batch)

    model = Model()
    t = L.Trainer(
        default_root_dir=outdir,
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=2,
        limit_test_batches=2,
        num_sanity_val_steps=0,
        logger=CSVLogger(outdir),
        **QUIET,
    )
    for fn in ("fit", "validate", "test"):
        getattr(t, fn)(model, **({} if fn == "fit" else {"verbose": False}))
        snapshots[fn] = dicts(t)
    return snapshots


def logged_epoch_value(outdir: str) -> dict[str, Any]:
    class Model(BoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            self.log("foo", float(batch_idx), on_step=True, on_epoch=True)
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch: Any, batch_idx: int) -> Any:
            self.log("bar", float(batch_idx), on_step=True, on_epoch=True)
            return super().validation_step(batch, batch_idx)

    out = {}
    for with_logger in (False, True):
        t = fit(
            Model(),
            os.path.join(outdir, str(with_logger)),
            max_epochs=1,
            limit_train_batches=3,
            limit_val_batches=3,
            logger=CSVLogger(outdir) if with_logger else False,
        )
        out[str(with_logger)] = dicts(t)
    return out


def batch_size_extraction(outdir: str) -> dict[str, Any]:
    class Model(BoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            self.log("auto", float(batch_idx), on_step=False, on_epoch=True)
            self.log("given", float(batch_idx), on_step=False, on_epoch=True, batch_size=1 + batch_idx)
            return super().training_step(batch["a"] if isinstance(batch, dict) else batch, batch_idx)

        def train_dataloader(self) -> Any:
            return DataLoader(RandomDictDataset(32, 10), batch_size=4)

    t = fit(Model(), outdir, max_epochs=1, limit_val_batches=0)
    return dicts(t)


def logger_after_each_call(outdir: str) -> dict[str, Any]:
    class Model(BoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            self.log("train", float(batch_idx))
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch: Any, batch_idx: int) -> Any:
            self.log("valid", float(batch_idx))
            return super().validation_step(batch, batch_idx)

        def test_step(self, batch: Any, batch_idx: int) -> Any:
            self.log("test", float(batch_idx))
            return super().test_step(batch, batch_idx)

    model = Model()
    t = L.Trainer(
        default_root_dir=outdir,
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=2,
        limit_test_batches=2,
        log_every_n_steps=1,
        logger=CSVLogger(outdir),
        **QUIET,
    )
    t.fit(model)
    t.test(model, verbose=False)
    t.predict(model, return_predictions=False)
    return {"rows": rows(outdir), **dicts(t)}


SECTIONS = [
    training_step_log,
    training_epoch_end_log,
    reduce_fx,
    dict_batches,
    log_in_train_callback,
    sync_dist_one_process,
    progress_bar_at_train_end,
    callback_self_log,
    metric_reduced_for_callbacks,
    log_invalid_values,
    log_misuse_raises,
    sanity_metrics_reset,
    sum_on_batch_hooks,
    epoch_and_step_rows,
    log_on_train_start,
    validation_step_log,
    validation_epoch_end_log,
    eval_epoch_logging,
    eval_float_and_auto_reduce,
    test_epoch_only_logging,
    multi_dataloader_suffix,
    log_in_eval_callbacks,
    multiple_dataloaders_reset,
    no_dataloader_idx,
    multi_dataloader_epoch_end,
    eval_step_rows,
    where_log_is_allowed,
    auto_add_dataloader_idx,
    metrics_reset_per_stage,
    logged_epoch_value,
    batch_size_extraction,
    logger_after_each_call,
]

if __name__ == "__main__":
    run_sections(sys.argv[1], SECTIONS, L.seed_everything)
