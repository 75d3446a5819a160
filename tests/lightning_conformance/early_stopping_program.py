"""The promises of Lightning 2.6.6's ``tests_pytorch/callbacks/test_early_stopping.py``, as scenarios of
ours. Where Lightning's tests force a stop by mocking ``_evaluate_stopping_criteria``, ours log a metric
that makes the criterion fire at the same check. One section per promise (see COVERAGE.md); run:
``python early_stopping_program.py OUTDIR``.
"""

from __future__ import annotations

import os
import pickle
import sys
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from observe import raises, run_sections, to_jsonable
from torch.utils.data import DataLoader, TensorDataset

QUIET = {"enable_progress_bar": False, "enable_model_summary": False, "logger": False}
SMALL = {"limit_train_batches": 2, "limit_val_batches": 2}


def _trainer(outdir: str, **kwargs: Any) -> L.Trainer:
    return L.Trainer(default_root_dir=outdir, **{"enable_checkpointing": False, **SMALL, **kwargs}, **QUIET)


def state_key(outdir: str) -> dict[str, Any]:
    return {"state_key": EarlyStopping(monitor="val_loss").state_key}


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 3)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.layer(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _loader(n: int, seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return DataLoader(TensorDataset(x, x.argmax(dim=1) % 3), batch_size=4)


class RecordingEarlyStopping(EarlyStopping):
    """Its state after every epoch, and what it holds when training starts."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.saved_states: list[dict[str, Any]] = []
        self.at_train_start: dict[str, Any] | None = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.at_train_start = to_jsonable(self.state_dict())

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        self.saved_states.append(to_jsonable(self.state_dict()))


def resume_from_checkpoint(outdir: str) -> dict[str, Any]:
    checkpoint = ModelCheckpoint(dirpath=os.path.join(outdir, "ckpts"), monitor="train_loss", save_top_k=1)
    early = RecordingEarlyStopping(monitor="train_loss")
    trainer = _trainer(
        outdir, callbacks=[early, checkpoint], num_sanity_val_steps=0, max_epochs=4, enable_checkpointing=True
    )
    model = Classifier()
    trainer.fit(model, _loader(16, 0), _loader(8, 1))
    out: dict[str, Any] = {"saved_states": early.saved_states, "state_key": early.state_key}
    restored = RecordingEarlyStopping(monitor="train_loss")
    trainer = _trainer(outdir, max_epochs=1, callbacks=[restored], num_sanity_val_steps=0)
    out["raised_past_max_epochs"] = raises(
        lambda: trainer.fit(model, _loader(16, 0), _loader(8, 1), ckpt_path=checkpoint.kth_best_model_path)
    )
    restored = RecordingEarlyStopping(monitor="train_loss")
    trainer = _trainer(outdir, max_epochs=5, callbacks=[restored], num_sanity_val_steps=0)
    trainer.fit(model, _loader(16, 0), _loader(8, 1), ckpt_path=checkpoint.kth_best_model_path)
    out["restored_at_train_start"] = restored.at_train_start
    return out


class CountingEarlyStopping(EarlyStopping):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.checks = 0
        self.evaluations = 0

    def _run_early_stopping_check(self, trainer: Any) -> None:
        self.checks += 1
        super()._run_early_stopping_check(trainer)

    def _evaluate_stopping_criteria(self, current: torch.Tensor) -> Any:
        self.evaluations += 1
        return super()._evaluate_stopping_criteria(current)


def no_extraneous_invocations(outdir: str) -> dict[str, Any]:
    early = CountingEarlyStopping(monitor="train_loss", patience=100)
    trainer = _trainer(outdir, callbacks=[early], max_epochs=4)
    trainer.fit(Classifier(), _loader(16, 0), _loader(8, 1))
    return {
        "checks": early.checks,
        "is_the_callback": trainer.early_stopping_callback is early,
        "callbacks": [cb is early for cb in trainer.early_stopping_callbacks],
    }


class LogsPerEpoch(BoringModel):
    """Logs `values[current_epoch]` as `name` at each validation's end (or train epoch's end)."""

    def __init__(self, name: str, values: list[Any], on_train: bool = False) -> None:
        super().__init__()
        self.name, self.values, self.on_train = name, values, on_train

    def on_validation_epoch_end(self) -> None:
        if not self.on_train:
            self.log(self.name, self.values[self.current_epoch])

    def on_train_epoch_end(self) -> None:
        if self.on_train:
            self.log(self.name, self.values[self.current_epoch])


PATIENCE_CASES = [([6, 5, 5, 5, 5, 5], 3), ([6, 5, 4, 4, 3, 3], 1), ([6, 5, 6, 5, 5, 5], 3)]


def patience(outdir: str) -> dict[str, Any]:
    out = []
    for losses, wait in PATIENCE_CASES:
        early = EarlyStopping(monitor="test_val_loss", patience=wait, verbose=True)
        trainer = _trainer(outdir, callbacks=[early], num_sanity_val_steps=0, max_epochs=10)
        trainer.fit(LogsPerEpoch("test_val_loss", list(torch.tensor(losses))))
        out.append([trainer.current_epoch, early.stopped_epoch, early.wait_count])
    return {"runs": out}


def patience_train(outdir: str) -> dict[str, Any]:
    out = []
    for no_validation in (True, False):
        for losses, wait in PATIENCE_CASES:
            model = LogsPerEpoch("train_loss", list(torch.tensor(losses)), on_train=True)
            if no_validation:
                model.validation_step = None
            early = EarlyStopping(
                monitor="train_loss", patience=wait, verbose=True, check_on_train_epoch_end=True
            )
            trainer = _trainer(outdir, callbacks=[early], num_sanity_val_steps=0, max_epochs=10)
            trainer.fit(model)
            out.append([no_validation, trainer.current_epoch, early.stopped_epoch])
    return {"runs": out}


def pickling(outdir: str) -> dict[str, Any]:
    early = EarlyStopping(monitor="foo")
    loaded = pickle.loads(pickle.dumps(early))
    same = {
        k: (repr(v) == repr(vars(loaded).get(k))) for k, v in vars(early).items() if not k.startswith("_")
    }
    return {"public_attributes_equal": all(same.values()), "monitor": loaded.monitor, "mode": loaded.mode}


class NoValidation(Classifier):
    validation_step = None  # type: ignore[assignment]


def no_val_step(outdir: str) -> dict[str, Any]:
    stopping = EarlyStopping(monitor="train_loss", min_delta=0.1, patience=0, check_on_train_epoch_end=True)
    trainer = _trainer(outdir, callbacks=[stopping], max_epochs=10, limit_train_batches=4)
    trainer.fit(NoValidation(), _loader(16, 0))
    return {
        "current_epoch": trainer.current_epoch,
        "stopped_epoch": stopping.stopped_epoch,
        "finished": trainer.state.status.value,
        "best_score": float(stopping.best_score),
    }


def thresholds(outdir: str) -> dict[str, Any]:
    out = []
    for stopping, divergence, losses in (
        (None, None, [8, 4, 2, 3, 4, 5, 8, 10]),
        (2.9, None, [9, 8, 7, 6, 5, 6, 4, 3, 2, 1]),
        (None, 15.9, [9, 4, 2, 16, 32, 64]),
    ):
        early = EarlyStopping(monitor="abc", stopping_threshold=stopping, divergence_threshold=divergence)
        trainer = _trainer(outdir, callbacks=[early], max_epochs=20)
        trainer.fit(LogsPerEpoch("abc", losses))
        out.append([trainer.current_epoch, early.stopped_epoch, early.stopping_reason.value])
    return {"runs": out}


def non_finite_monitor(outdir: str) -> dict[str, Any]:
    out = []
    for bad in (torch.tensor(torch.inf), torch.tensor(torch.nan)):
        early = EarlyStopping(monitor="val_loss", check_finite=True)
        trainer = _trainer(outdir, callbacks=[early], max_epochs=10)
        trainer.fit(LogsPerEpoch("val_loss", [4, 3, bad, 2, 1]))
        out.append([trainer.current_epoch, early.stopped_epoch, early.stopping_reason.value])
    return {"runs": out}


class LogsBatchIdx(BoringModel):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.log("foo", batch_idx)
        return super().training_step(batch, batch_idx)


def min_epochs_min_steps_global_step(outdir: str) -> dict[str, Any]:
    """A stopping threshold above every value: the first check (each epoch's end) asks to stop."""
    out = []
    for batches, min_epochs, min_steps in (
        (3, 0, 10),
        (5, 0, 10),
        (3, 2, 0),
        (5, 2, 0),
        (3, 1, 10),
        (5, 1, 10),
        (3, 3, 10),
        (5, 3, 10),
    ):
        early = EarlyStopping("foo", stopping_threshold=1000.0)
        trainer = _trainer(
            outdir,
            callbacks=early,
            limit_val_batches=0,
            limit_train_batches=batches,
            min_epochs=min_epochs,
            min_steps=min_steps,
        )
        trainer.fit(LogsBatchIdx())
        out.append([trainer.should_stop, trainer.current_epoch, trainer.global_step])
    return {"runs": out}


def mode_options(outdir: str) -> dict[str, Any]:
    return {"unknown_mode_raises": raises(lambda: EarlyStopping(monitor="foo", mode="unknown_option"))}


class TwoMetrics(BoringModel):
    def __init__(self, on_train: bool) -> None:
        super().__init__()
        self.on_train = on_train
        self.end_epoch: int | None = None

    def _epoch_end(self) -> None:
        self.log("abc", torch.tensor([8, 4, 2, 3, 4, 5, 8, 10][self.current_epoch]))
        self.log("cba", torch.tensor(0))

    def on_train_epoch_end(self) -> None:
        if self.on_train:
            self._epoch_end()

    def on_validation_epoch_end(self) -> None:
        if not self.on_train:
            self._epoch_end()

    def on_train_end(self) -> None:
        self.end_epoch = self.trainer.current_epoch


def multiple_early_stopping_callbacks(outdir: str) -> dict[str, Any]:
    out = []
    for on_train in (False, True):
        check = {"check_on_train_epoch_end": True} if on_train else {}
        for order in ("abc_first", "cba_first"):
            abc = EarlyStopping("abc", **check)
            cba = EarlyStopping("cba", patience=3, **check)
            model = TwoMetrics(on_train)
            trainer = _trainer(
                outdir, callbacks=[abc, cba] if order == "abc_first" else [cba, abc], max_epochs=20
            )
            trainer.fit(model)
            out.append([on_train, order, model.end_epoch, abc.stopped_epoch, cba.stopped_epoch])
    return {"runs": out}


class LogsConstant(BoringModel):
    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        self.log("foo", 1)
        return super().validation_step(batch, batch_idx)


def check_on_train_epoch_end_smart_handling(outdir: str) -> dict[str, Any]:
    """A constant metric with patience 0: the first check passes, the second stops."""
    out = {}
    for case, kwargs in {
        "val_check_interval": {"val_check_interval": 0.3, "limit_train_batches": 10, "max_epochs": 10},
        "check_val_every_n_epoch": {"check_val_every_n_epoch": 2, "max_epochs": 5},
    }.items():
        early = CountingEarlyStopping(monitor="foo", patience=0)
        trainer = _trainer(outdir, callbacks=early, **{**kwargs, "limit_val_batches": 1})
        trainer.fit(LogsConstant())
        out[case] = [early.evaluations, trainer.global_step, trainer.current_epoch]
    return out


class SetsNestedMetric(L.Callback):
    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        trainer.callback_metrics["foo"] = torch.tensor([[[float(5 - trainer.current_epoch)]]])


def squeezes(outdir: str) -> dict[str, Any]:
    early = EarlyStopping(monitor="foo", stopping_threshold=3.5)
    trainer = _trainer(outdir, callbacks=[SetsNestedMetric(), early], max_epochs=6)
    trainer.fit(BoringModel())
    return {"best_score": early.best_score.tolist(), "stopped_epoch": early.stopped_epoch}


class EpochLosses(BoringModel):
    def __init__(self, losses: list[float], after: float) -> None:
        super().__init__()
        self.losses, self.after = losses, after

    def on_validation_epoch_end(self) -> None:
        e = self.current_epoch
        self.log("val_loss", self.losses[e] if e < len(self.losses) else self.after)


def reasons(outdir: str) -> dict[str, Any]:
    out = []
    for losses, after, kwargs, max_epochs, phrase in (
        ([10.0], 10.0, {"patience": 2}, 10, "did not improve"),
        (
            [5.0, 3.0, 1.0, 0.5],
            0.1,
            {"stopping_threshold": 0.6, "mode": "min"},
            10,
            "Stopping threshold reached",
        ),
        (
            [1.0, 2.0, 5.0, 10.0],
            15.0,
            {"divergence_threshold": 8.0, "mode": "min"},
            10,
            "Divergence threshold",
        ),
        ([1.0, 0.5, float("nan")], float("nan"), {"check_finite": True}, 10, "is not finite"),
        ([5.0, 4.0, 3.0, 2.0, 1.0], 0.1, {"patience": 3}, 3, None),
    ):
        early = EarlyStopping(monitor="val_loss", verbose=True, **kwargs)
        trainer = _trainer(outdir, callbacks=[early], max_epochs=max_epochs)
        trainer.fit(EpochLosses(losses, after))
        message = early.stopping_reason_message
        out.append(
            [
                early.stopping_reason.value,
                None if message is None else (phrase is not None and phrase in message),
                early.stopped_epoch,
            ]
        )
    early = EarlyStopping(monitor="val_loss", patience=3)
    early.stopping_reason = type(early.stopping_reason).PATIENCE_EXHAUSTED
    early.stopping_reason_message = "Test message"
    restored = EarlyStopping(monitor="val_loss", patience=3)
    restored.load_state_dict(early.state_dict())
    old = EarlyStopping(monitor="val_loss", patience=3)
    old.load_state_dict({"wait_count": 2, "stopped_epoch": 5, "best_score": torch.tensor(0.5), "patience": 3})
    return {
        "fits": out,
        "restored": [restored.stopping_reason.value, restored.stopping_reason_message],
        "old_state": [
            old.stopping_reason.value,
            old.stopping_reason_message,
            old.wait_count,
            old.stopped_epoch,
        ],
    }


SECTIONS = [
    state_key,
    resume_from_checkpoint,
    no_extraneous_invocations,
    patience,
    patience_train,
    pickling,
    no_val_step,
    thresholds,
    non_finite_monitor,
    min_epochs_min_steps_global_step,
    mode_options,
    multiple_early_stopping_callbacks,
    check_on_train_epoch_end_smart_handling,
    squeezes,
    reasons,
]

if __name__ == "__main__":
    run_sections(sys.argv[1], SECTIONS, L.seed_everything)
