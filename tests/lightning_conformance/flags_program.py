"""What Lightning 2.6's ``tests_pytorch/trainer/flags/*`` promise about the Trainer's loop flags,
as scenarios of our own: ``check_val_every_n_epoch``, ``min/max_steps/epochs``, ``barebones``,
``fast_dev_run``, ``inference_mode``, ``limit_*_batches``, ``overfit_batches`` and
``val_check_interval``. One section per promise (``run_sections``: a section that raises records
its error). Run: ``python flags_program.py OUTDIR``.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset, RandomIterableDataset
from lightning.pytorch.loggers import CSVLogger
from observe import run_sections
from torch.utils.data import DataLoader, Sampler

QUIET = {"accelerator": "cpu", "devices": 1, "enable_progress_bar": False, "enable_model_summary": False}


def raises(make: Any) -> bool:
    """Whether building/calling `make` raised (the message is the framework's own)."""
    try:
        make()
    except Exception:
        return True
    return False


class Counting(BoringModel):
    """Counts epochs, validation epochs (fit-time only) and the steps where validation ran."""

    def __init__(self) -> None:
        super().__init__()
        self.train_epochs = 0
        self.val_epochs = 0
        self.val_batches_per_epoch: list[int] = []
        self.val_steps: list[int] = []
        self._val_batches = 0

    def on_train_epoch_start(self) -> None:
        self.train_epochs += 1
        self._val_batches = 0

    def on_validation_epoch_start(self) -> None:
        if not self.trainer.sanity_checking:
            self.val_epochs += 1

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        if not self.trainer.sanity_checking:
            self._val_batches += 1
            self.val_steps.append(self.global_step)
        return super().validation_step(batch, batch_idx)

    def on_train_epoch_end(self) -> None:
        self.val_batches_per_epoch.append(self._val_batches)


def _fit(model: BoringModel, outdir: str, **kwargs: Any) -> L.Trainer:
    options = {"logger": False, "enable_checkpointing": False, **QUIET, **kwargs}
    trainer = L.Trainer(default_root_dir=outdir, **options)
    trainer.fit(model)
    return trainer


# ---- test_check_val_every_n_epoch.py ------------------------------------------------------------
def check_val_every_n_epoch(outdir: str) -> dict[str, Any]:
    out = {}
    for max_epochs in (1, 4, 5):
        model = Counting()
        _fit(
            model,
            outdir,
            max_epochs=max_epochs,
            num_sanity_val_steps=0,
            limit_train_batches=2,
            limit_val_batches=2,
            check_val_every_n_epoch=2,
        )
        out[str(max_epochs)] = [model.val_epochs, model.val_batches_per_epoch]
    return out


def check_val_every_n_epoch_with_max_steps(outdir: str) -> dict[str, Any]:
    class Model(Counting):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(RandomDataset(32, 2))

    model = Model()
    trainer = _fit(model, outdir, max_steps=8, check_val_every_n_epoch=3, num_sanity_val_steps=0)
    return {
        "epoch": trainer.current_epoch,
        "step": trainer.global_step,
        "val_steps": sorted(set(model.val_steps)),
    }


# ---- test_min_max_epochs.py ---------------------------------------------------------------------
def min_max_steps_epochs(outdir: str) -> dict[str, Any]:
    out = {}
    for min_epochs, max_epochs, min_steps, max_steps in [
        (None, 3, None, -1),
        (None, None, 10, 20),
        (1, 3, None, -1),
        (1, None, None, 20),
        (None, 3, 10, -1),
    ]:
        trainer = _fit(
            BoringModel(),
            outdir,
            min_epochs=min_epochs,
            max_epochs=max_epochs,
            min_steps=min_steps,
            max_steps=max_steps,
            limit_train_batches=8,
            limit_val_batches=1,
        )
        key = f"{min_epochs}-{max_epochs}-{min_steps}-{max_steps}"
        out[key] = [trainer.global_step, trainer.current_epoch, trainer.max_steps]
    return out


def max_epochs_not_set(outdir: str) -> dict[str, Any]:
    class StopAtOnce(BoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            self.trainer.should_stop = True
            return super().training_step(batch, batch_idx)

    trainer = _fit(StopAtOnce(), outdir, max_epochs=None, limit_train_batches=1, limit_val_batches=1)
    return {"max_epochs": trainer.max_epochs, "epoch": trainer.current_epoch, "step": trainer.global_step}


# ---- test_barebones.py --------------------------------------------------------------------------
def barebones_selection(outdir: str) -> dict[str, Any]:
    trainer = L.Trainer(barebones=True, default_root_dir=outdir, accelerator="cpu", devices=1)
    return {
        "barebones": trainer.barebones,
        "checkpoint_callbacks": len(trainer.checkpoint_callbacks),
        "loggers": len(trainer.loggers),
        "progress_bar": trainer.progress_bar_callback is not None,
        "summaries": sum(type(cb).__name__ == "ModelSummary" for cb in trainer.callbacks),
        "log_every_n_steps": trainer.log_every_n_steps,
        "num_sanity_val_steps": trainer.num_sanity_val_steps,
        "fast_dev_run": bool(trainer.fast_dev_run),
    }


def barebones_raises(outdir: str) -> dict[str, Any]:
    conflicting = {
        "enable_checkpointing": True,
        "logger": True,
        "enable_progress_bar": True,
        "enable_model_summary": True,
        "log_every_n_steps": 1,
        "num_sanity_val_steps": 1,
        "fast_dev_run": 1,
        "detect_anomaly": True,
    }
    out = {k: raises(lambda k=k, v=v: L.Trainer(barebones=True, **{k: v})) for k, v in conflicting.items()}
    out["plain"] = raises(lambda: L.Trainer(barebones=True))
    return out


def barebones_log(outdir: str) -> dict[str, Any]:
    class Logs(BoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            out = super().training_step(batch, batch_idx)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                self.log("foo", 1.0)
                self.log_dict({"bar": 2.0})
            self.warned.append(len(caught))
            return out

        def __init__(self) -> None:
            super().__init__()
            self.warned: list[int] = []

    model = Logs()
    trainer = L.Trainer(
        barebones=True,
        max_steps=2,
        limit_val_batches=0,
        default_root_dir=outdir,
        accelerator="cpu",
        devices=1,
    )
    trainer.fit(model)
    return {
        "warned": [n > 0 for n in model.warned],
        "callback_metrics": sorted(trainer.callback_metrics),
        "logged_metrics": sorted(trainer.logged_metrics),
    }


# ---- test_fast_dev_run.py -----------------------------------------------------------------------
class FastDevRunModel(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.counts = {"train": 0, "train_epoch_end": 0, "val": 0, "val_epoch_end": 0, "test": 0}

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.log("some_metric", torch.tensor(7.0))
        self.counts["train"] += 1
        return super().training_step(batch, batch_idx)

    def on_train_epoch_end(self) -> None:
        self.counts["train_epoch_end"] += 1

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        self.counts["val"] += 1
        return super().validation_step(batch, batch_idx)

    def on_validation_epoch_end(self) -> None:
        self.counts["val_epoch_end"] += 1

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        self.counts["test"] += 1
        return super().test_step(batch, batch_idx)


def fast_dev_run(outdir: str) -> dict[str, Any]:
    out = {}
    for n in (1, 4):
        for with_val in (True, False):
            where = os.path.join(outdir, f"run{n}{with_val}")
            os.makedirs(where)
            model = FastDevRunModel()
            if not with_val:
                model.validation_step = None
            checkpoint = ModelCheckpoint(dirpath=os.path.join(where, "ckpts"))
            early = EarlyStopping(monitor="foo")
            trainer = L.Trainer(
                default_root_dir=where,
                fast_dev_run=n,
                val_check_interval=2,
                logger=CSVLogger(where),
                log_every_n_steps=1,
                callbacks=[checkpoint, early],
                **QUIET,
            )
            trainer.fit(model)
            trainer.test(model, verbose=False)
            out[f"{n}-{with_val}"] = {
                "counts": model.counts,
                "max_steps": trainer.max_steps,
                "num_sanity_val_steps": trainer.num_sanity_val_steps,
                "max_epochs": trainer.max_epochs,
                "val_check_interval": trainer.val_check_interval,
                "check_val_every_n_epoch": trainer.check_val_every_n_epoch,
                "checkpoint_dir_exists": os.path.exists(os.path.join(where, "ckpts")),
                "files": sorted(os.listdir(where)),
                "early_stopping_wait": early.wait_count,
                "global_step": trainer.global_step,
            }
    return out


# ---- test_inference_mode.py ---------------------------------------------------------------------
def inference_mode(outdir: str) -> dict[str, Any]:
    class Probe(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[list[Any]] = []

        def _note(self) -> None:
            self.seen.append([torch.is_grad_enabled(), torch.is_inference_mode_enabled()])

        on_validation_start = _note
        on_test_start = _note
        on_predict_start = _note

    out = {}
    for mode in (False, True):
        for fn in ("validate", "test", "predict"):
            model = Probe()
            trainer = L.Trainer(
                default_root_dir=outdir, logger=False, inference_mode=mode, fast_dev_run=True, **QUIET
            )
            getattr(trainer, fn)(model, **({} if fn == "predict" else {"verbose": False}))
            out[f"{fn}-{mode}"] = model.seen
    return out


# ---- test_limit_batches.py ----------------------------------------------------------------------
def num_dataloader_batches(outdir: str) -> dict[str, Any]:
    out = {}
    for limit in (100, 7):
        model = BoringModel()
        trainer = _fit(model, outdir, limit_val_batches=limit, limit_train_batches=limit, max_epochs=1)
        out[str(limit)] = {
            "num_val_batches": list(trainer.num_val_batches),
            "num_training_batches": trainer.num_training_batches,
            "loader_lengths": [len(model.train_dataloader()), len(model.val_dataloader())],
        }
    return out


def eval_limit_batches(outdir: str) -> dict[str, Any]:
    out = {}
    for mode, fn, count in (("val", "validate", "num_val_batches"), ("test", "test", "num_test_batches")):
        for limit in (0.1, 10):
            trainer = L.Trainer(
                default_root_dir=outdir, logger=False, **QUIET, **{f"limit_{mode}_batches": limit}
            )
            getattr(trainer, fn)(BoringModel(), verbose=False)
            out[f"{mode}-{limit}"] = list(getattr(trainer, count))
    for limit in (0.1, 10):
        trainer = L.Trainer(default_root_dir=outdir, logger=False, limit_predict_batches=limit, **QUIET)
        out[f"predict-{limit}"] = len(trainer.predict(BoringModel()))
    return out


# ---- test_overfit_batches.py --------------------------------------------------------------------
def overfit_basic(outdir: str) -> dict[str, Any]:
    out = {}
    for overfit in (1, 2, 0.1, 0.25, 1.0):
        model = BoringModel()
        model.validation_step = None
        trainer = _fit(model, outdir, max_epochs=1, overfit_batches=overfit)
        out[str(overfit)] = {
            "num_val_batches": list(trainer.num_val_batches),
            "num_training_batches": trainer.num_training_batches,
            "step": trainer.global_step,
        }
    return out


class _InOrder(Sampler):
    """A sampler that is not torch's SequentialSampler but yields in order."""

    def __init__(self, data: Any) -> None:
        self.data = data

    def __iter__(self) -> Any:
        return iter(range(len(self.data)))

    def __len__(self) -> int:
        return len(self.data)


def overfit_same_batches(outdir: str) -> dict[str, Any]:
    """overfit_batches: shuffling off, the same first batches for training and validation."""

    class Model(BoringModel):
        def __init__(self, shuffle: bool, custom_sampler: bool) -> None:
            super().__init__()
            self.shuffle, self.custom_sampler = shuffle, custom_sampler
            self.train_batches: list[Any] = []
            self.val_batches: list[Any] = []

        def _loader(self) -> DataLoader:
            data = RandomDataset(32, 16)
            if self.custom_sampler:
                return DataLoader(data, batch_size=2, sampler=_InOrder(data))
            return DataLoader(data, batch_size=2, shuffle=self.shuffle)

        def train_dataloader(self) -> DataLoader:
            return self._loader()

        def val_dataloader(self) -> DataLoader:
            return self._loader()

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            self.train_batches.append(batch[:, 0].tolist())
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch: Any, batch_idx: int) -> Any:
            if not self.trainer.sanity_checking:
                self.val_batches.append(batch[:, 0].tolist())
            return super().validation_step(batch, batch_idx)

    out = {}
    for overfit in (1, 2):
        for shuffle, custom in ((False, False), (True, False), (False, True)):
            torch.manual_seed(0)
            model = Model(shuffle, custom)
            trainer = _fit(model, outdir, max_epochs=2, overfit_batches=overfit)
            out[f"{overfit}-{shuffle}-{custom}"] = {
                "train": model.train_batches,
                "val": model.val_batches,
                "num_training_batches": trainer.num_training_batches,
                "num_val_batches": list(trainer.num_val_batches),
            }
    return out


def overfit_eval_limits(outdir: str) -> dict[str, Any]:
    """overfit_batches limits validation like training, but not test or predict."""
    out = {}
    for overfit in (0.25, 4):
        trainer = _fit(BoringModel(), outdir, max_epochs=1, overfit_batches=overfit, num_sanity_val_steps=0)
        fit_val = list(trainer.num_val_batches)
        trainer.test(BoringModel(), verbose=False)
        predictions = trainer.predict(BoringModel())
        out[str(overfit)] = {
            "train": trainer.num_training_batches,
            "val": fit_val,
            "test": list(trainer.num_test_batches),
            "predict": len(predictions),
        }
    return out


# ---- test_val_check_interval.py -----------------------------------------------------------------
def val_check_interval(outdir: str) -> dict[str, Any]:
    out = {}
    for max_epochs in (1, 2, 3):
        for denominator in (1, 3, 4):
            model = Counting()
            _fit(
                model,
                outdir,
                max_epochs=max_epochs,
                val_check_interval=1 / denominator,
                limit_train_batches=12,
                limit_val_batches=1,
            )
            out[f"{max_epochs}-{denominator}"] = [model.train_epochs, model.val_epochs, model.val_steps]
    return out


class _Endless(Counting):
    """A train loader of 4 batches, or an unsized one of 112; each validation noted as (training
    batches seen, global_step)."""

    def __init__(self, infinite: bool) -> None:
        super().__init__()
        self.infinite, self.batches, self.val_at = infinite, 0, []

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomIterableDataset(32, count=112) if self.infinite else RandomDataset(32, 4))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.batches += 1

    def on_validation_start(self) -> None:
        self.val_at.append([self.batches, self.global_step])


def _interval_run(outdir: str, infinite: bool, accumulate: int) -> dict[str, Any]:
    model = _Endless(infinite)
    trainer = _fit(
        model,
        outdir,
        limit_val_batches=1,
        max_steps=12 // accumulate,
        val_check_interval=3,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        accumulate_grad_batches=accumulate,
    )
    return {"epoch": trainer.current_epoch, "step": trainer.global_step, "val_at": model.val_at}


def val_check_interval_exceeds_epoch(outdir: str) -> dict[str, Any]:
    """An int interval with check_val_every_n_epoch=None counts batches across epochs."""
    return {str(infinite): _interval_run(outdir, infinite, 1) for infinite in (True, False)}


def val_check_mid_window(outdir: str) -> dict[str, Any]:
    """The same with accumulation 2: every other check batch falls inside a window."""
    return {str(infinite): _interval_run(outdir, infinite, 2) for infinite in (True, False)}


def val_check_interval_errors(outdir: str) -> dict[str, Any]:
    def too_long() -> None:
        trainer = L.Trainer(
            limit_train_batches=10, val_check_interval=100, logger=False, enable_checkpointing=False, **QUIET
        )
        trainer.fit(BoringModel())

    return {
        "exceeds_train_batches": raises(too_long),
        "float_with_none_every_n_epoch": raises(
            lambda: L.Trainer(val_check_interval=0.5, check_val_every_n_epoch=None, **QUIET)
        ),
    }


SECTIONS = [
    check_val_every_n_epoch,
    check_val_every_n_epoch_with_max_steps,
    min_max_steps_epochs,
    max_epochs_not_set,
    barebones_selection,
    barebones_raises,
    barebones_log,
    fast_dev_run,
    inference_mode,
    num_dataloader_batches,
    eval_limit_batches,
    overfit_basic,
    overfit_same_batches,
    overfit_eval_limits,
    val_check_interval,
    val_check_interval_exceeds_epoch,
    val_check_mid_window,
    val_check_interval_errors,
]

if __name__ == "__main__":
    run_sections(sys.argv[1], SECTIONS, L.seed_everything)
