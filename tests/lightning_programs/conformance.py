"""Small scenarios where nanolight once behaved unlike Lightning (issue "Lightning conformance",
item 3), each recorded as its own section of ``observed.json`` so a test can name the one that differs.

- ``epoch_end_monitor``: ``EarlyStopping(check_on_train_epoch_end=True)`` monitoring a metric the
  module logs in its own ``on_train_epoch_end``.
- ``fit_twice``: a second ``fit`` on the same trainer with ``fit_loop.max_epochs`` raised
  (Lightning's ``test_restore.py::test_fit_twice``).
- ``min_steps_stop``: ``should_stop`` set at step 1 with ``min_steps=5``.
- ``state_dict_override``: a module whose ``state_dict()`` takes no arguments.
- ``hparams_reload``: ``save_hyperparameters(config_dict)``, a dataclass module, and
  ``load_from_checkpoint(..., strict=False)`` into a module with an extra layer.
- ``clip_two_optimizers``: ``clip_gradients(opt_a, ...)`` under manual optimization with two optimizers.
- ``train_calls``: every ``module.train(mode)`` call over a fit with a sanity check.
- ``setup_stage``: what ``setup(stage)`` / ``teardown(stage)`` receive.
- ``resume_mid_epoch``: ``fit(ckpt_path="last")`` after ``max_steps`` stopped mid-epoch (hooks and
  counters only: the data a plain loader yields after such a resume is a known difference).

Each section runs on its own; an exception is recorded as the section's ``error``.
Run: ``python conformance.py OUTDIR``.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from observe import write_observed
from torch.utils.data import DataLoader, TensorDataset

QUIET = {
    "accelerator": "cpu",
    "devices": 1,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "logger": False,
}


def loader(n: int = 8, seed: int = 0, batch_size: int = 2) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=batch_size)


class Net(L.LightningModule):
    """A linear regression; subclasses add what a section observes."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.layer(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self.layer(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


# ---- epoch_end_monitor -----------------------------------------------------------------------
class EpochEndLogger(Net):
    def on_train_epoch_end(self) -> None:
        self.log("train_metric", [3.0, 2.0, 2.0, 2.0, 2.0, 2.0][self.current_epoch])


def epoch_end_monitor(outdir: str) -> dict[str, Any]:
    early = EarlyStopping(monitor="train_metric", check_on_train_epoch_end=True, patience=1)
    trainer = L.Trainer(
        max_epochs=6, limit_train_batches=2, callbacks=[early], default_root_dir=outdir, **QUIET
    )
    trainer.fit(EpochEndLogger(), loader())
    return {
        "current_epoch": trainer.current_epoch,
        "stopped_epoch": early.stopped_epoch,
        "wait_count": early.wait_count,
        "best_score": float(early.best_score),
    }


# ---- fit_twice -------------------------------------------------------------------------------
def fit_twice(outdir: str) -> dict[str, Any]:
    epochs: list[int] = []

    class TestModel(BoringModel):
        def on_train_epoch_end(self, *_: Any) -> None:
            epochs.append(self.current_epoch)

    trainer = L.Trainer(
        max_epochs=2,
        limit_train_batches=1,
        limit_val_batches=1,
        default_root_dir=outdir,
        enable_checkpointing=False,
        **QUIET,
    )
    trainer.fit(TestModel())
    after_first = [trainer.current_epoch, trainer.global_step]
    trainer.fit_loop.max_epochs = 4
    trainer.fit(TestModel())
    return {
        "epochs": epochs,
        "after_first": after_first,
        "after_second": [trainer.current_epoch, trainer.global_step],
    }


# ---- min_steps_stop --------------------------------------------------------------------------
class StopEarly(Net):
    def __init__(self) -> None:
        super().__init__()
        self.trace: list[list[Any]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.trace.append(["train", self.current_epoch, batch_idx, self.global_step])
        if self.global_step == 1:
            self.trainer.should_stop = True
        return super().training_step(batch, batch_idx)

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking:
            self.trace.append(["val_end", self.current_epoch, self.global_step])

    def on_train_epoch_end(self) -> None:
        self.trace.append(["epoch_end", self.current_epoch, self.global_step])


def min_steps_stop(outdir: str) -> dict[str, Any]:
    model = StopEarly()
    trainer = L.Trainer(
        max_epochs=3,
        min_steps=5,
        num_sanity_val_steps=0,
        default_root_dir=outdir,
        enable_checkpointing=False,
        **QUIET,
    )
    trainer.fit(model, loader(16), loader(4, seed=1))
    return {"trace": model.trace, "current_epoch": trainer.current_epoch, "global_step": trainer.global_step}


# ---- state_dict_override ---------------------------------------------------------------------
class PlainStateDict(Net):
    def state_dict(self) -> dict[str, Any]:  # as Lightning's docs override it: no arguments
        return super().state_dict()


def state_dict_override(outdir: str) -> dict[str, Any]:
    model = PlainStateDict()
    trainer = L.Trainer(max_epochs=1, default_root_dir=outdir, enable_checkpointing=False, **QUIET)
    trainer.fit(model, loader())
    path = os.path.join(outdir, "plain_state_dict.ckpt")
    trainer.save_checkpoint(path)
    loaded = PlainStateDict.load_from_checkpoint(path)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), loaded.parameters(), strict=True))
    return {"global_step": trainer.global_step, "reloaded_equal": same}


# ---- hparams_reload --------------------------------------------------------------------------
class DictHparams(Net):
    def __init__(self, config: dict) -> None:
        super().__init__()
        self.save_hyperparameters(config)
        self.layer = torch.nn.Linear(config["width"], 1)


@dataclass(eq=False)
class DataclassModule(Net):
    width: int = 4
    lr: float = 0.01

    def __post_init__(self) -> None:
        super().__init__()
        self.save_hyperparameters()


class Bigger(Net):
    def __init__(self) -> None:
        super().__init__()
        self.extra = torch.nn.Linear(1, 1)


def _fit_and_save(model: L.LightningModule, outdir: str, name: str) -> str:
    trainer = L.Trainer(max_steps=1, default_root_dir=outdir, enable_checkpointing=False, **QUIET)
    trainer.fit(model, loader())
    path = os.path.join(outdir, f"{name}.ckpt")
    trainer.save_checkpoint(path)
    return path


def _same_layer(a: L.LightningModule, b: L.LightningModule) -> bool:
    return torch.equal(a.layer.weight, b.layer.weight) and torch.equal(a.layer.bias, b.layer.bias)


def hparams_reload(outdir: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model = DictHparams({"width": 4, "name": "dict"})
    path = _fit_and_save(model, outdir, "dict_hparams")
    loaded = DictHparams.load_from_checkpoint(path)
    out["dict"] = {"hparams": dict(loaded.hparams), "weights_equal": _same_layer(model, loaded)}
    dc = DataclassModule(width=4, lr=0.5)
    out["dataclass_hparams"] = dict(dc.hparams)
    path = _fit_and_save(dc, outdir, "dataclass_hparams")
    loaded_dc = DataclassModule.load_from_checkpoint(path)
    out["dataclass"] = {
        "hparams": dict(loaded_dc.hparams),
        "lr": loaded_dc.lr,
        "weights_equal": _same_layer(dc, loaded_dc),
    }
    small = Net()
    path = _fit_and_save(small, outdir, "small")
    big = Bigger.load_from_checkpoint(path, strict=False)
    out["strict_false"] = {"weights_equal": _same_layer(small, big), "extra": type(big.extra).__name__}
    return out


# ---- clip_two_optimizers ---------------------------------------------------------------------
class TwoOptimizers(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.a = torch.nn.Linear(4, 1)
        self.b = torch.nn.Linear(4, 1)
        self.norms: list[list[float]] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt_a, opt_b = self.optimizers()
        x, y = batch
        loss = 100.0 * F.mse_loss(self.a(x) + self.b(x), y)
        self.manual_backward(loss)
        self.clip_gradients(opt_a, gradient_clip_val=0.01, gradient_clip_algorithm="norm")
        norms = [
            torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in m.parameters()]))
            for m in (self.a, self.b)
        ]
        self.norms.append([float(n) for n in norms])
        opt_a.step()
        opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(self.a.parameters(), lr=0.01), torch.optim.SGD(self.b.parameters(), lr=0.01)]


def clip_two_optimizers(outdir: str) -> dict[str, Any]:
    model = TwoOptimizers()
    trainer = L.Trainer(max_epochs=1, default_root_dir=outdir, enable_checkpointing=False, **QUIET)
    trainer.fit(model, loader())
    return {"grad_norms_after_clip": model.norms}


# ---- train_calls -----------------------------------------------------------------------------
class TrainRecorder(Net):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[list[Any]] = []

    def train(self, mode: bool = True) -> TrainRecorder:
        trainer = self._trainer
        if trainer is not None:
            stage = trainer.state.stage
            self.calls.append([mode, getattr(stage, "value", stage)])
        return super().train(mode)


def train_calls(outdir: str) -> dict[str, Any]:
    model = TrainRecorder()
    trainer = L.Trainer(
        max_epochs=1, limit_train_batches=2, limit_val_batches=1, default_root_dir=outdir, **QUIET
    )
    trainer.fit(model, loader(), loader(4, seed=1))
    return {"calls": model.calls}


# ---- setup_stage -----------------------------------------------------------------------------
def _describe(stage: Any) -> list[Any]:
    return [repr(stage), str(stage), f"{stage}", type(stage).__name__, stage == "fit", isinstance(stage, str)]


class StageRecorder(Net):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[Any]] = []

    def setup(self, stage: str) -> None:
        self.seen.append(["setup", *_describe(stage)])

    def teardown(self, stage: str) -> None:
        self.seen.append(["teardown", *_describe(stage)])


def setup_stage(outdir: str) -> dict[str, Any]:
    model = StageRecorder()
    trainer = L.Trainer(
        max_epochs=1, limit_train_batches=1, limit_val_batches=1, default_root_dir=outdir, **QUIET
    )
    trainer.fit(model, loader(), loader(4, seed=1))
    trainer.validate(model, loader(4, seed=1), verbose=False)
    return {"seen": model.seen, "fn": _describe(trainer.state.fn)}


# ---- resume_mid_epoch ------------------------------------------------------------------------
class HookCounter(Net):
    def __init__(self) -> None:
        super().__init__()
        self.trace: list[list[Any]] = []

    def _note(self, hook: str, *extra: Any) -> None:
        self.trace.append([hook, self.current_epoch, self.global_step, *extra])

    def on_fit_start(self) -> None:
        self._note("on_fit_start")

    def on_train_start(self) -> None:
        self._note("on_train_start")

    def on_train_epoch_start(self) -> None:
        self._note("on_train_epoch_start")

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._note("on_train_batch_start", batch_idx)

    def on_train_epoch_end(self) -> None:
        self._note("on_train_epoch_end")

    def on_train_end(self) -> None:
        self._note("on_train_end")


def resume_mid_epoch(outdir: str) -> dict[str, Any]:
    dirpath = os.path.join(outdir, "resume_ckpts")
    out = {}
    for name, max_steps, ckpt_path in (("first", 6, None), ("resumed", 10, "last")):
        model = HookCounter()
        trainer = L.Trainer(
            max_steps=max_steps,
            callbacks=[ModelCheckpoint(dirpath=dirpath, save_last=True)],
            default_root_dir=outdir,
            **QUIET,
        )
        trainer.fit(model, loader(8), ckpt_path=ckpt_path)
        out[name] = {
            "trace": model.trace,
            "global_step": trainer.global_step,
            "current_epoch": trainer.current_epoch,
        }
    return out


SECTIONS: list[Callable[[str], dict[str, Any]]] = [
    epoch_end_monitor,
    fit_twice,
    min_steps_stop,
    state_dict_override,
    hparams_reload,
    clip_two_optimizers,
    train_calls,
    setup_stage,
    resume_mid_epoch,
]


def main(outdir: str) -> None:
    observed: dict[str, Any] = {}
    for section in SECTIONS:
        L.seed_everything(3)
        where = os.path.join(outdir, section.__name__)
        os.makedirs(where)
        try:
            observed[section.__name__] = section(where)
        except Exception as exc:  # one section's failure must not hide the others'
            traceback.print_exc()
            observed[section.__name__] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    write_observed(outdir, observed)


if __name__ == "__main__":
    main(sys.argv[1])
