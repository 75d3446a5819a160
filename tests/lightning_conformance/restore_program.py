"""The promises of Lightning 2.6.6's ``tests_pytorch/models/test_restore.py``, as scenarios of ours: what a
run resumed with ``ckpt_path`` sees (counters, weights, optimizer and scheduler state, callback state),
``load_from_checkpoint`` (hparams, weights, ``strict``, ``hparams_file``), and pickling a module. One
section per promise (see COVERAGE.md); run: ``python restore_program.py OUTDIR``.
"""

from __future__ import annotations

import os
import pickle
import sys
from typing import Any, Generic, TypeVar

import cloudpickle
import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger
from observe import by_stem, listing, relative, run_sections, to_jsonable

QUIET = {"enable_progress_bar": False, "enable_model_summary": False}


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


class Parity(L.Callback):
    """Trainer and module counters at every training hook."""

    def __init__(self) -> None:
        self.seen: list[list[Any]] = []

    def _note(self, hook: str, trainer: Any, module: Any) -> None:
        self.seen.append(
            [hook, trainer.global_step, module.global_step, trainer.current_epoch, module.current_epoch]
        )

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self._note("on_train_start", trainer, module)

    def on_train_batch_start(self, trainer: Any, module: Any, *_: Any) -> None:
        self._note("on_train_batch_start", trainer, module)

    def on_train_batch_end(self, trainer: Any, module: Any, *_: Any) -> None:
        self._note("on_train_batch_end", trainer, module)

    def on_train_end(self, trainer: Any, module: Any) -> None:
        self._note("on_train_end", trainer, module)


def model_properties_fit_ckpt_path(outdir: str) -> dict[str, Any]:
    model = BoringModel()
    out = []
    for max_epochs, resume in ((1, False), (2, True)):
        parity = Parity()
        trainer = L.Trainer(
            default_root_dir=outdir,
            max_epochs=max_epochs,
            limit_train_batches=2,
            limit_val_batches=2,
            logger=False,
            callbacks=[ModelCheckpoint(dirpath=outdir, save_last=True), parity],
            **QUIET,
        )
        trainer.fit(model, ckpt_path=by_stem(outdir, "last") if resume else None)
        out.append(parity.seen)
    return {"runs": out}


class StepLRModel(BoringModel):
    """Adam + StepLR; records what each stage sees when it starts."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, Any] = {}

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=0.1)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)]

    def _note(self, hook: str) -> None:
        trainer = self.trainer
        entry: dict[str, Any] = {"epoch": trainer.current_epoch, "global_step": trainer.global_step}
        entry["weights"] = to_jsonable(self.layer.weight.sum())
        if hook == "on_train_start":
            opt = trainer.optimizers[0]
            entry["adam_steps"] = [to_jsonable(s["step"]) for s in opt.state.values()]
            entry["lr"] = opt.param_groups[0]["lr"]
            entry["scheduler_last_epoch"] = trainer.lr_scheduler_configs[0].scheduler.last_epoch
        self.seen[hook] = entry

    def on_train_start(self) -> None:
        self._note("on_train_start")

    def on_validation_start(self) -> None:
        if not self.trainer.sanity_checking:
            self._note("on_validation_start")

    def on_test_start(self) -> None:
        self._note("on_test_start")

    def on_predict_start(self) -> None:
        self._note("on_predict_start")


def trainer_properties_restore_ckpt_path(outdir: str) -> dict[str, Any]:
    args = {
        "default_root_dir": outdir,
        "max_epochs": 1,
        "limit_train_batches": 2,
        "limit_val_batches": 2,
        "limit_test_batches": 2,
        "limit_predict_batches": 2,
        "logger": False,
        "num_sanity_val_steps": 0,
        **QUIET,
    }
    first = StepLRModel()
    trainer = L.Trainer(**args, callbacks=[ModelCheckpoint(dirpath=outdir, save_last=True)])
    trainer.fit(first)
    out: dict[str, Any] = {"after_fit": to_jsonable(first.layer.weight.sum())}
    for fn in ("fit", "validate", "test", "predict"):
        model = StepLRModel()
        trainer = L.Trainer(**{**args, "max_epochs": 3}, enable_checkpointing=False)
        getattr(trainer, fn)(model, ckpt_path=by_stem(outdir, "last"))
        out[fn] = model.seen
    return out


def correct_step_and_epoch(outdir: str) -> dict[str, Any]:
    args = {"default_root_dir": outdir, "limit_train_batches": 2, "limit_val_batches": 0, **QUIET}
    trainer = L.Trainer(max_epochs=2, **args)
    before = [trainer.current_epoch, trainer.global_step]
    trainer.fit(BoringModel())
    after = [trainer.current_epoch, trainer.global_step]
    path = os.path.join(outdir, "model.ckpt")
    trainer.save_checkpoint(path)
    parity = Parity()
    trainer = L.Trainer(max_epochs=4, callbacks=[parity], **args)
    fresh = [trainer.current_epoch, trainer.global_step]
    trainer.fit(BoringModel(), ckpt_path=path)
    return {
        "before": before,
        "after": after,
        "fresh": fresh,
        "resumed_train_start": parity.seen[0],
        "resumed_end": [trainer.current_epoch, trainer.global_step],
    }


def non_existing_checkpoint(outdir: str) -> dict[str, Any]:
    trainer = L.Trainer(logger=False, default_root_dir=outdir, **QUIET)
    try:
        trainer.fit(BoringModel(), ckpt_path=os.path.join(outdir, "non_existing.ckpt"))
    except Exception as exc:
        return {"file_not_found": isinstance(exc, FileNotFoundError)}
    return {"file_not_found": False}


class Classifier(BoringModel):
    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        out = super().validation_step(batch, batch_idx)
        self.log("val_loss", out["x"])
        return out


class CaptureCheckpoint(L.Callback):
    """The ModelCheckpoint's selection as `on_fit_start` sees it."""

    def __init__(self, outdir: str) -> None:
        self.outdir = outdir
        self.at_fit_start: dict[str, Any] = {}

    def on_fit_start(self, trainer: Any, module: Any) -> None:
        self.at_fit_start = _selection(trainer.checkpoint_callback, self.outdir)


def _selection(cb: ModelCheckpoint, outdir: str) -> dict[str, Any]:
    return {
        "best_model_path": relative(cb.best_model_path, outdir),
        "best_model_score": None if cb.best_model_score is None else float(cb.best_model_score),
        "best_k_models": {relative(k, outdir): float(v) for k, v in cb.best_k_models.items()},
        "kth_best_model_path": relative(cb.kth_best_model_path, outdir),
        "kth_value": float(cb.kth_value),
        "last_model_path": relative(cb.last_model_path, outdir),
    }


def callbacks_state_fit_ckpt_path(outdir: str) -> dict[str, Any]:
    model = Classifier()
    out = {}
    for name, ckpt_path in (("first", None), ("resumed", "last")):
        capture = CaptureCheckpoint(outdir)
        checkpoint = ModelCheckpoint(dirpath=outdir, monitor="val_loss", save_last=True)
        trainer = L.Trainer(
            default_root_dir=outdir,
            limit_train_batches=1,
            limit_val_batches=2,
            max_epochs=1,
            logger=False,
            callbacks=[checkpoint, capture],
            **QUIET,
        )
        trainer.fit(model, ckpt_path=None if ckpt_path is None else by_stem(outdir, "last"))
        out[name] = {"at_fit_start": capture.at_fit_start, "after": _selection(checkpoint, outdir)}
    return out


def callbacks_references_fit_ckpt_path(outdir: str) -> dict[str, Any]:
    args = {"default_root_dir": outdir, "max_steps": 1, "logger": False, "limit_val_batches": 2}
    model = Classifier()
    out = []
    for ckpt_path in (None, "last"):
        checkpoint = ModelCheckpoint(dirpath=outdir, monitor="val_loss", save_last=True)
        trainer = L.Trainer(**args, num_sanity_val_steps=0, callbacks=[checkpoint], **QUIET)
        out.append([checkpoint is trainer.callbacks[-1], checkpoint is trainer.checkpoint_callback])
        trainer.fit(model, ckpt_path=None if ckpt_path is None else by_stem(outdir, "last"))
        out.append([checkpoint is trainer.callbacks[-1], checkpoint is trainer.checkpoint_callback])
    return {"identities": out}


class ValTestLoss(BoringModel):
    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        out = super().validation_step(batch, batch_idx)
        self.log("val_loss", out["x"])
        return out

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        out = super().test_step(batch, batch_idx)
        self.log("test_loss", out["y"])
        return out


T = TypeVar("T")


class GenericParent(Generic[T], ValTestLoss):
    def __init__(self, batch_size: int = 4) -> None:
        super().__init__(batch_size=batch_size)


class GenericValTestLoss(GenericParent[int]):
    pass


def running_test_pretrained_model(outdir: str) -> dict[str, Any]:
    options = {
        "max_epochs": 2,
        "limit_train_batches": 2,
        "limit_val_batches": 2,
        "limit_test_batches": 2,
        "default_root_dir": outdir,
        **QUIET,
    }
    model = ValTestLoss()
    trainer = L.Trainer(
        **options,
        logger=CSVLogger(outdir),
        callbacks=[ModelCheckpoint(dirpath=f"{outdir}/ck", monitor="val_loss")],
    )
    trainer.fit(model)
    pretrained = ValTestLoss.load_from_checkpoint(trainer.checkpoint_callback.best_model_path)
    new_trainer = L.Trainer(**options, logger=CSVLogger(outdir))
    result = new_trainer.test(pretrained, verbose=False)
    return {
        "status": trainer.state.status.value,
        "best": relative(trainer.checkpoint_callback.best_model_path, outdir),
        "test": to_jsonable(result),
    }


def load_model_from_checkpoint(outdir: str) -> dict[str, Any]:
    out = {}
    for template in (ValTestLoss, GenericValTestLoss):
        where = os.path.join(outdir, template.__name__)
        options = {
            "max_epochs": 2,
            "limit_train_batches": 2,
            "limit_val_batches": 2,
            "limit_test_batches": 2,
            "default_root_dir": where,
            "logger": False,
            **QUIET,
        }
        model = template()
        checkpoint = ModelCheckpoint(dirpath=where, monitor="val_loss", save_top_k=-1)
        trainer = L.Trainer(**options, callbacks=[checkpoint])
        trainer.fit(model)
        tested = trainer.test(model, verbose=False)
        files = [f for f in listing(where) if f != "last"]  # nanolight's `last` pointer: README
        last = os.path.join(where, sorted(n for n in os.listdir(where) if n.startswith("epoch="))[-1])
        pretrained = template.load_from_checkpoint(last)
        new_trainer = L.Trainer(**options)
        out[template.__name__] = {
            "files": files,
            "hparams": dict(pretrained.hparams),
            "same_weights": _same_weights(model, pretrained),
            "test": to_jsonable(tested),
            "pretrained_test": to_jsonable(new_trainer.test(pretrained, verbose=False)),
        }
    return out


def model_saving_loading(outdir: str) -> dict[str, Any]:
    model = BoringModel()
    model.save_hyperparameters({"width": 32})  # something for hparams.yaml to hold
    logger = CSVLogger(outdir)
    trainer = L.Trainer(
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=2,
        logger=logger,
        callbacks=[ModelCheckpoint(dirpath=outdir)],
        default_root_dir=outdir,
        **QUIET,
    )
    trainer.fit(model)
    batch = next(iter(model.test_dataloader()))
    model.eval()
    before = model(batch)
    path = os.path.join(outdir, "save_test.ckpt")
    trainer.save_checkpoint(path)
    hparams_file = os.path.join(logger.log_dir, "hparams.yaml")
    loaded = BoringModel.load_from_checkpoint(checkpoint_path=path, hparams_file=hparams_file)
    loaded.eval()
    return {"same_prediction": bool(torch.equal(before, loaded(batch))), "training": loaded.training}


def _saved_boring(outdir: str, model: BoringModel) -> str:
    trainer = L.Trainer(
        default_root_dir=outdir,
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=2,
        logger=False,
        callbacks=[ModelCheckpoint(dirpath=outdir)],
        **QUIET,
    )
    trainer.fit(model)
    path = os.path.join(outdir, "save_test.ckpt")
    trainer.save_checkpoint(path)
    return path


class ExtraLayer(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.c_d3 = torch.nn.Linear(7, 7)


def _strict_loads(cls: type, path: str) -> dict[str, Any]:
    loose = cls.load_from_checkpoint(checkpoint_path=path, strict=False)
    try:
        cls.load_from_checkpoint(checkpoint_path=path, strict=True)
        strict = "loaded"
    except Exception as exc:
        strict = sorted(k for k in ("c_d3.weight", "c_d3.bias") if k in str(exc))
    return {"loose_layer": loose.layer.weight.shape[0], "strict": strict}


def strict_model_load_more_params(outdir: str) -> dict[str, Any]:
    model = BoringModel()
    model.c_d3 = torch.nn.Linear(32, 32)
    return _strict_loads(BoringModel, _saved_boring(outdir, model))


def strict_model_load_less_params(outdir: str) -> dict[str, Any]:
    return _strict_loads(ExtraLayer, _saved_boring(outdir, BoringModel()))


def model_pickle(outdir: str) -> dict[str, Any]:
    model = BoringModel()
    restored = pickle.loads(pickle.dumps(model))
    cloudpickle.dumps(model)
    return {"same_weights": _same_weights(model, restored)}


class ExtendedBoringModel(BoringModel):
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.layer.parameters(), lr=0.001)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)]

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.step(batch), on_epoch=True, prog_bar=True)


def finetuning_with_ckpt_path(outdir: str) -> dict[str, Any]:
    """``checkpointing/test_trainer_checkpoint.py``: each new trainer resumed from the previous best
    has its own default ModelCheckpoint, whose best is its own newest epoch."""
    checkpoint = ModelCheckpoint(monitor="val_loss", dirpath=outdir, filename="{epoch:02d}", save_top_k=-1)
    model = ExtendedBoringModel()
    limits = {"limit_train_batches": 12, "limit_test_batches": 12}
    trainer = L.Trainer(
        default_root_dir=outdir,
        max_epochs=1,
        limit_val_batches=6,
        callbacks=[checkpoint],
        logger=False,
        **limits,
        **QUIET,
    )
    trainer.fit(model)
    files = [n for n in listing(outdir) if n != "last"]
    best = [checkpoint.best_model_path]
    for max_epochs in range(3, 6):
        trainer = L.Trainer(
            default_root_dir=outdir, max_epochs=max_epochs, limit_val_batches=12, **limits, **QUIET
        )
        trainer.fit(model, ckpt_path=best[-1])
        trainer.test(verbose=False)
        best.append(trainer.checkpoint_callback.best_model_path)
    return {"files": files, "best": [relative(p, outdir) for p in best]}


SECTIONS = [
    model_properties_fit_ckpt_path,
    trainer_properties_restore_ckpt_path,
    correct_step_and_epoch,
    non_existing_checkpoint,
    callbacks_state_fit_ckpt_path,
    callbacks_references_fit_ckpt_path,
    running_test_pretrained_model,
    load_model_from_checkpoint,
    model_saving_loading,
    strict_model_load_more_params,
    strict_model_load_less_params,
    model_pickle,
    finetuning_with_ckpt_path,
]

if __name__ == "__main__":
    run_sections(sys.argv[1], SECTIONS, L.seed_everything)
