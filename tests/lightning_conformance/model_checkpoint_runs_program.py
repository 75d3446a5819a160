"""The promises of Lightning 2.6.6's ``tests_pytorch/checkpointing/test_model_checkpoint.py`` about whole
runs, as scenarios of ours: exceptions (``save_on_exception``), reruns into the same directory, resumes,
callback state, ``save_last`` and scores (``model_checkpoint_program.py`` has the names, triggers and
selection). Paths are relative to the section, checkpoints by stem; nanolight's ``last`` pointer is left
out of a listing unless ``save_last`` asked for a last checkpoint (README). One section per promise
(see COVERAGE.md); run: ``python model_checkpoint_runs_program.py OUTDIR``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger
from observe import by_stem, listing, raises, relative, run_sections, selection

QUIET = {"enable_progress_bar": False, "enable_model_summary": False, "logger": False}


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


class ListDir(BoringModel):
    def __init__(self, where: str) -> None:
        super().__init__()
        self.where, self.seen = where, []

    def on_train_epoch_start(self) -> None:
        self.seen.append(listing(self.where))


def _last_only(cb: ModelCheckpoint, outdir: str) -> dict[str, Any]:
    """Only a last checkpoint: Lightning writes last.ckpt alone, nanolight the step's directory that
    `last` names (README), so the listing is left out."""
    state = selection(cb, outdir)
    return {**{k: v for k, v in state.items() if k != "files"}, "has_last": "last" in state["files"]}


class Troubled(BoringModel):
    def __init__(self, where: str, at: int = 2) -> None:
        super().__init__()
        self.where, self.at = where, at

    def on_validation_start(self) -> None:
        if self.where == "sanity" and self.trainer.sanity_checking:
            raise RuntimeError("Trouble!")

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.where == "train_batch_start" and batch_idx == self.at:
            raise RuntimeError("Trouble!")

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.where == "training_step" and batch_idx == self.at:
            raise RuntimeError("Trouble!")
        return super().training_step(batch, batch_idx)

    def on_train_epoch_end(self) -> None:
        if self.where == "train_epoch_end" and self.current_epoch == 1:
            raise RuntimeError("Trouble!")

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        if self.where == "validation_step" and not self.trainer.sanity_checking and self.current_epoch == 1:
            raise RuntimeError("Trouble!")
        return super().validation_step(batch, batch_idx)


class TroubledCallback(L.Callback):
    def __init__(self, where: str) -> None:
        self.where = where

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if self.where == "cb_train_batch_end" and trainer.global_step == 3:
            raise RuntimeError("Trouble!")

    def on_validation_end(self, trainer: Any, *args: Any) -> None:
        if self.where == "cb_validation_end" and not trainer.sanity_checking:
            raise RuntimeError("Trouble!")


def on_exception(outdir: str) -> dict[str, Any]:
    out = {}
    cases = {
        "sanity": {},
        "fast_dev_run": {"fast_dev_run": True},
        "train_batch_start": {},
        "training_step": {},
        "train_epoch_end": {},
        "validation_step": {},
        "cb_train_batch_end": {},
        "cb_validation_end": {},
    }
    for where, kwargs in cases.items():
        d = os.path.join(outdir, where)
        cb = ModelCheckpoint(dirpath=d, filename=where, save_on_exception=True)
        model = Troubled(
            "train_batch_start" if where == "fast_dev_run" else where, at=0 if where == "fast_dev_run" else 2
        )
        trainer = L.Trainer(
            default_root_dir=d,
            callbacks=[cb, TroubledCallback(where)],
            **{"max_epochs": 3, "limit_train_batches": 4, "limit_val_batches": 2, **QUIET, **kwargs},
        )
        raised = raises(trainer.fit, model)
        out[where] = {"raised": raised, "files": files_of(cb), "global_step": trainer.global_step}
    return out


def already_saved_on_exception(outdir: str) -> dict[str, Any]:
    """The step that raised was saved already: no exception checkpoint."""
    cb = ModelCheckpoint(
        dirpath=outdir, filename="already_saved", save_on_exception=True, every_n_train_steps=2
    )
    trainer = L.Trainer(default_root_dir=outdir, callbacks=[cb], max_epochs=1, limit_train_batches=4, **QUIET)
    raised = raises(trainer.fit, Troubled("train_batch_start", at=2))
    return {"raised": raised, "files": files_of(cb)}


def save_last_checkpoint_contents(outdir: str) -> dict[str, Any]:
    cb = ModelCheckpoint(monitor="early_stop_on", dirpath=outdir, save_top_k=-1, save_last=True)
    _fit(outdir, LogInTwoMethods(), cb, max_epochs=2, limit_train_batches=4, limit_val_batches=2)
    newest = BoringModel.load_from_checkpoint(by_stem(outdir, "epoch=1-step=8"))
    last = BoringModel.load_from_checkpoint(cb.last_model_path)
    return {
        "same_weights": all(
            torch.equal(a, b) for a, b in zip(newest.parameters(), last.parameters(), strict=True)
        )
    }


class Scores(BoringModel):
    def __init__(self, scores: list[float]) -> None:
        super().__init__()
        self.scores = scores

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking:
            self.log("abc", torch.tensor(self.scores[self.current_epoch]))


def nan_as_first(outdir: str) -> dict[str, Any]:
    out = {}
    for mode in ("min", "max"):
        where = os.path.join(outdir, mode)
        cb = ModelCheckpoint(monitor="abc", mode=mode, save_top_k=1, dirpath=where)
        _fit(
            where,
            Scores([float("nan"), 5.0, 8.0, 6.0]),
            cb,
            max_epochs=4,
            limit_train_batches=2,
            limit_val_batches=2,
        )
        out[mode] = selection(cb, where)
    return out


class FooPerStep(BoringModel):
    def __init__(self, values: list[float]) -> None:
        super().__init__()
        self.values = values

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.log("foo", self.values[self.global_step])
        return super().training_step(batch, batch_idx)


def current_score(outdir: str) -> dict[str, Any]:
    cb = ModelCheckpoint(dirpath=outdir, save_top_k=3, monitor="foo", mode="min", every_n_train_steps=1)
    _fit(outdir, FooPerStep([0.1, 0.2, 0.3, 0.4]), cb, max_steps=3, limit_val_batches=0)
    return selection(cb, outdir)


def current_score_when_nan(outdir: str) -> dict[str, Any]:
    out = {}
    for mode in ("min", "max"):
        where = os.path.join(outdir, mode)
        cb = ModelCheckpoint(dirpath=where, save_top_k=1, monitor="foo", mode=mode, every_n_train_steps=1)
        _fit(where, FooPerStep([float("nan")]), cb, max_steps=1, limit_val_batches=0)
        out[mode] = selection(cb, where)
    return out


def version_after_rerun(outdir: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i in range(2):
        cb = ModelCheckpoint(dirpath=outdir, save_top_k=-1, monitor="epoch", filename="{epoch}")
        _fit(outdir, BoringModel(), cb, max_epochs=2, limit_train_batches=1, limit_val_batches=1)
        out[f"new_trainer_{i}"] = sorted(relative(p, outdir) for p in cb.best_k_models)
    out["files"] = [n for n in listing(outdir) if n != "last"]
    return out


def version_after_rerun_same_trainer(outdir: str) -> dict[str, Any]:
    cb = ModelCheckpoint(dirpath=outdir, save_top_k=-1, monitor="epoch", filename="test")
    trainer = L.Trainer(
        default_root_dir=outdir,
        callbacks=[cb],
        max_epochs=2,
        limit_train_batches=1,
        limit_val_batches=1,
        **QUIET,
    )
    trainer.fit(BoringModel())
    trainer.fit_loop.max_epochs = 4
    trainer.fit(BoringModel())
    return {"best_k": sorted(relative(p, outdir) for p in cb.best_k_models), "files": files_of(cb)}


def version_counter_disabled(outdir: str) -> dict[str, Any]:
    out = {}
    for i in range(2):
        cb = ModelCheckpoint(
            dirpath=outdir,
            save_top_k=-1,
            save_last=True,
            monitor="epoch",
            filename="{epoch}",
            enable_version_counter=False,
        )
        _fit(outdir, BoringModel(), cb, max_epochs=2, limit_train_batches=1, limit_val_batches=1)
        out[str(i)] = selection(cb, outdir)
    return out


def saveload_ckpt(outdir: str) -> dict[str, Any]:
    written = ModelCheckpoint(dirpath=outdir, save_top_k=-1, save_last=True, monitor="epoch")
    _fit(outdir, BoringModel(), written, max_epochs=2, limit_train_batches=1, limit_val_batches=1)
    same_dir = ModelCheckpoint(dirpath=outdir, save_top_k=-1, save_last=True, monitor="epoch")
    same_dir.load_state_dict(written.state_dict())
    other = ModelCheckpoint(
        dirpath=os.path.join(outdir, "restore"), monitor=None, save_top_k=-1, save_last=True
    )
    other.load_state_dict(written.state_dict())
    return {"same_dir": selection(same_dir, outdir), "other_dir": selection(other, outdir)}


def resume_and_old_checkpoint_files_remain(outdir: str) -> dict[str, Any]:
    out = {}
    kw = {"limit_train_batches": 10, "limit_val_batches": 0}
    for same in (True, False):
        first, second = os.path.join(outdir, str(same), "first"), os.path.join(outdir, str(same), "second")
        model = BoringModel()
        cb = ModelCheckpoint(dirpath=first, monitor="step", mode="max", save_top_k=2, every_n_train_steps=2)
        _fit(outdir, model, cb, max_steps=5, **kw)
        before = files_of(cb)
        cb2 = ModelCheckpoint(
            dirpath=first if same else second, monitor="step", mode="max", save_top_k=2, every_n_train_steps=2
        )
        trainer = L.Trainer(default_root_dir=outdir, callbacks=[cb2], max_steps=8, **kw, **QUIET)
        trainer.fit(model, ckpt_path=by_stem(first, "epoch=0-step=4"))
        out[str(same)] = {
            "before": before,
            "first": [n for n in listing(first) if n != "last"],
            "second": [n for n in listing(second) if n != "last"],
        }
    return out


def expand_home(outdir: str) -> dict[str, Any]:
    home = os.path.expanduser("~")
    return {
        "tilde": ModelCheckpoint(dirpath="~/checkpoints").dirpath == os.path.join(home, "checkpoints"),
        "relative": ModelCheckpoint(dirpath="./~/checkpoints").dirpath
        == os.path.join(os.getcwd(), "~", "checkpoints"),
    }


def save_last_without_validation(outdir: str) -> dict[str, Any]:
    model = BoringModel()
    model.validation_step = None
    cb = ModelCheckpoint(dirpath=outdir, save_last=True, save_on_train_epoch_end=False)
    _fit(outdir, model, cb, max_epochs=2, limit_train_batches=2)
    return _last_only(cb, outdir)


class SelectiveLoss(BoringModel):
    def on_validation_epoch_end(self) -> None:
        e = self.current_epoch
        self.log("val_loss", torch.tensor(1.0 - e * 0.1 if e % 2 == 0 else 1.0 + e * 0.1))


def save_last_only_when_checkpoint_saved(outdir: str) -> dict[str, Any]:
    cb = ModelCheckpoint(dirpath=outdir, monitor="val_loss", save_top_k=1, save_last=True)
    model = ListDir(outdir)
    model.on_validation_epoch_end = SelectiveLoss.on_validation_epoch_end.__get__(model)  # type: ignore[method-assign]
    _fit(outdir, model, cb, max_epochs=4, limit_train_batches=1, limit_val_batches=1, num_sanity_val_steps=0)
    return {**selection(cb, outdir), "seen": model.seen}


class ValLoss(BoringModel):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.step(batch))


def checkpoint_repeated_strategy(outdir: str) -> dict[str, Any]:
    """Fits resumed from the best checkpoint and tests from it leave the directory as it was."""
    cb = ModelCheckpoint(monitor="val_loss", dirpath=outdir, filename="{epoch:02d}")
    kwargs = {
        "max_epochs": 1,
        "limit_train_batches": 2,
        "limit_val_batches": 2,
        "limit_test_batches": 2,
        "log_every_n_steps": 1,
        "default_root_dir": outdir,
        "logger": CSVLogger(outdir),
        **{k: v for k, v in QUIET.items() if k != "logger"},
    }
    model = ValLoss()
    L.Trainer(**kwargs, callbacks=[cb]).fit(model)
    seen = [[n for n in listing(outdir) if n != "last"]]
    for _ in range(3):
        trainer = L.Trainer(**kwargs)
        trainer.fit(model, ckpt_path=cb.best_model_path)
        trainer.test(ckpt_path=cb.best_model_path, verbose=False)
        seen.append([n for n in listing(outdir) if n != "last"])
    return {"seen": seen, "versions": listing(os.path.join(outdir, "lightning_logs"))}


def resume_training_preserves_old_ckpt_last(outdir: str) -> dict[str, Any]:
    kwargs = {"default_root_dir": outdir, "limit_train_batches": 3, "limit_val_batches": 0, **QUIET}
    mc = {
        "filename": "{step}",
        "monitor": "step",
        "mode": "max",
        "save_last": True,
        "save_top_k": 2,
        "every_n_train_steps": 1,
    }
    model = BoringModel()
    L.Trainer(max_epochs=1, callbacks=ModelCheckpoint(**mc), **kwargs).fit(model)
    first = os.path.join(outdir, "checkpoints")
    before = listing(first)
    new = ModelCheckpoint(dirpath=os.path.join(outdir, "new"), **mc)
    L.Trainer(max_epochs=2, callbacks=new, **kwargs).fit(model, ckpt_path=by_stem(first, "step=2"))
    return {"before": before, "after": listing(first), "new": files_of(new)}


class CountSaves(L.Callback):
    def __init__(self) -> None:
        self.saves = 0

    def on_save_checkpoint(self, *args: Any) -> None:
        self.saves += 1


def save_last_every_n_epochs_interaction(outdir: str) -> dict[str, Any]:
    out = {}
    for n in (0, 5):
        where = os.path.join(outdir, str(n))
        mc = ModelCheckpoint(every_n_epochs=n, save_last=True, save_top_k=0, save_on_train_epoch_end=True)
        count = CountSaves()
        trainer = L.Trainer(
            default_root_dir=where,
            max_epochs=2,
            callbacks=[mc, count],
            limit_train_batches=1,
            limit_val_batches=0,
            **QUIET,
        )
        trainer.fit(BoringModel())
        out[str(n)] = {"last_model_path": relative(mc.last_model_path, where), "saves": count.saves}
    return out


def load_with_inf_data_loader(outdir: str) -> dict[str, Any]:
    from lightning.pytorch.demos.boring_classes import RandomIterableDataset
    from torch.utils.data import DataLoader

    class Iterable(BoringModel):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(RandomIterableDataset(size=32, count=10))

        def val_dataloader(self) -> DataLoader:
            return DataLoader(RandomIterableDataset(size=32, count=10))

    kwargs = {"default_root_dir": outdir, "limit_train_batches": 2, "limit_val_batches": None, **QUIET}
    model = Iterable()
    cb = ModelCheckpoint(save_last=True, every_n_train_steps=1)
    L.Trainer(max_epochs=2, callbacks=cb, **kwargs).fit(model)
    files = files_of(cb)
    trainer = L.Trainer(
        max_epochs=4, callbacks=ModelCheckpoint(save_last=True, every_n_train_steps=1), **kwargs
    )
    trainer.fit(model, ckpt_path=by_stem(cb.dirpath, "epoch=1-step=4"))
    return {"files": files, "resumed": [trainer.current_epoch, trainer.global_step]}


SECTIONS = [
    on_exception,
    already_saved_on_exception,
    save_last_checkpoint_contents,
    version_after_rerun,
    version_after_rerun_same_trainer,
    version_counter_disabled,
    saveload_ckpt,
    resume_and_old_checkpoint_files_remain,
    expand_home,
    checkpoint_repeated_strategy,
    resume_training_preserves_old_ckpt_last,
    load_with_inf_data_loader,
    save_last_every_n_epochs_interaction,
    save_last_without_validation,
    save_last_only_when_checkpoint_saved,
    current_score,
    current_score_when_nan,
    nan_as_first,
]

if __name__ == "__main__":
    run_sections(sys.argv[1], SECTIONS, L.seed_everything)
