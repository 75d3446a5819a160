"""What Lightning 2.6's ``tests_pytorch/models/test_hooks.py`` and ``core/test_lightning_module.py``
promise, as scenarios of our own: every hook of a module, a callback and a datamodule recorded
(with its simple arguments) over fit (automatic and manual optimization, with or without
validation, resumed by epochs or by steps), validate / test with and without batches, predict, and
``load_from_checkpoint``; the module's properties, ``toggle_optimizer``, ``configure_gradient_clipping``
and submodules' train/eval modes. One section per promise (``run_sections``).
Run: ``python hooks_program.py OUTDIR``.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

import lightning as L
import torch
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel, RandomDataset
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.model_helpers import is_overridden
from observe import run_sections
from torch import nn
from torch.utils.data import DataLoader

QUIET = {"accelerator": "cpu", "devices": 1, "enable_progress_bar": False, "enable_model_summary": False}

MODULE_HOOKS = [
    "configure_callbacks", "prepare_data", "setup", "configure_model", "configure_optimizers",
    "on_fit_start", "on_fit_end", "on_train_start", "on_train_end", "on_train_epoch_start",
    "on_train_epoch_end", "on_train_batch_start", "on_train_batch_end", "on_validation_start",
    "on_validation_end", "on_validation_epoch_start", "on_validation_epoch_end",
    "on_validation_batch_start", "on_validation_batch_end", "on_validation_model_eval",
    "on_validation_model_train", "on_validation_model_zero_grad", "on_test_start", "on_test_end",
    "on_test_epoch_start", "on_test_epoch_end", "on_test_batch_start", "on_test_batch_end",
    "on_test_model_eval", "on_test_model_train", "on_predict_start", "on_predict_end",
    "on_predict_epoch_start", "on_predict_epoch_end", "on_predict_batch_start", "on_predict_batch_end",
    "on_predict_model_eval", "on_before_batch_transfer", "transfer_batch_to_device",
    "on_after_batch_transfer", "on_before_backward", "backward", "on_after_backward",
    "on_before_optimizer_step", "on_before_zero_grad", "optimizer_zero_grad", "optimizer_step",
    "configure_gradient_clipping", "clip_gradients", "lr_scheduler_step", "on_save_checkpoint",
    "on_load_checkpoint", "teardown", "train_dataloader", "val_dataloader", "test_dataloader",
    "predict_dataloader", "training_step", "validation_step", "test_step", "predict_step", "forward",
    "zero_grad", "train", "manual_backward",
]  # fmt: skip
CALLBACK_HOOKS = [
    "setup", "teardown", "on_fit_start", "on_fit_end", "on_sanity_check_start", "on_sanity_check_end",
    "on_train_start", "on_train_end", "on_train_epoch_start", "on_train_epoch_end",
    "on_train_batch_start", "on_train_batch_end", "on_validation_start", "on_validation_end",
    "on_validation_epoch_start", "on_validation_epoch_end", "on_validation_batch_start",
    "on_validation_batch_end", "on_test_start", "on_test_end", "on_test_epoch_start",
    "on_test_epoch_end", "on_test_batch_start", "on_test_batch_end", "on_predict_start",
    "on_predict_end", "on_predict_epoch_start", "on_predict_epoch_end", "on_predict_batch_start",
    "on_predict_batch_end", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
    "on_before_zero_grad", "on_save_checkpoint", "on_load_checkpoint", "state_dict", "load_state_dict",
]  # fmt: skip
DATAMODULE_HOOKS = [
    "prepare_data", "setup", "teardown", "train_dataloader", "val_dataloader", "test_dataloader",
    "predict_dataloader", "state_dict", "load_state_dict", "on_before_batch_transfer",
    "transfer_batch_to_device", "on_after_batch_transfer",
]  # fmt: skip


def simple(value: Any, trainer: Any = None, module: Any = None) -> Any:
    """An argument as JSON: numbers, strings and flags as they are, the trainer and module by role,
    a checkpoint by its epoch and step, tensors and framework objects by kind only."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if trainer is not None and value is trainer:
        return "trainer"
    if module is not None and value is module:
        return "module"
    if isinstance(value, torch.device):
        return str(value)
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, dict) and "global_step" in value and "epoch" in value:
        return {"checkpoint": [value["epoch"], value["global_step"]]}
    if isinstance(value, dict):
        return {str(k): simple(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [simple(v) for v in value]
    return "object"


class Recorder:
    """Replaces hooks on instances by recorders that note the call, then run the original."""

    def __init__(self) -> None:
        self.calls: list[list[Any]] = []
        self.trainer: Any = None
        self.module: Any = None

    def _note(self, who: str, name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        entry: list[Any] = [f"{who}{name}", [simple(a, self.trainer, self.module) for a in args]]
        if kwargs:
            entry.append({k: simple(v, self.trainer, self.module) for k, v in sorted(kwargs.items())})
        self.calls.append(entry)
        return fn(*args, **kwargs)

    def attach(self, obj: Any, who: str, names: list[str]) -> Any:
        for name in names:
            original = getattr(obj, name, None)
            if original is None:
                continue
            recorder = functools.partial(self._note, who, name, original)
            functools.update_wrapper(recorder, original)
            setattr(obj, name, recorder)
        return obj


class HookedModel(BoringModel):
    """A BoringModel overriding the hooks Lightning calls only when overridden."""

    def __init__(self, recorder: Recorder | None = None, manual: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = not manual
        if recorder is not None:
            recorder.module = self
            recorder.attach(self, "", MODULE_HOOKS)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.automatic_optimization:
            return super().training_step(batch, batch_idx)
        loss = self.step(batch)
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return {"loss": loss}

    def configure_model(self) -> None: ...

    def on_validation_model_train(self) -> None: ...

    def on_test_model_train(self) -> None: ...

    def on_predict_model_train(self) -> None: ...

    def prepare_data(self) -> None: ...


class HookedCallback(L.Callback):
    def state_dict(self) -> dict[str, Any]:
        return {"foo": True}


def _trainer(outdir: str, recorder: Recorder, **kwargs: Any) -> L.Trainer:
    callback = recorder.attach(HookedCallback(), "Callback.", CALLBACK_HOOKS)
    trainer = L.Trainer(default_root_dir=outdir, logger=False, callbacks=[callback], **QUIET, **kwargs)
    recorder.trainer = trainer
    return trainer


# ---- test_hooks.py ------------------------------------------------------------------------------
def on_before_zero_grad_count(outdir: str) -> dict[str, Any]:
    out = {}
    for max_steps in (1, 2, 3):

        class Model(BoringModel):
            calls = 0

            def on_before_zero_grad(self, optimizer: Any) -> None:
                self.calls += 1

        model = Model()
        trainer = L.Trainer(default_root_dir=outdir, max_steps=max_steps, max_epochs=2, logger=False, **QUIET)
        trainer.fit(model)
        fit_calls, model.calls = model.calls, 0
        trainer.test(model, verbose=False)
        out[str(max_steps)] = [fit_calls, model.calls]
    return out


def epoch_end_progress_bar_metrics(outdir: str) -> dict[str, Any]:
    class Model(BoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            out = super().training_step(batch, batch_idx)
            self.log_dict(
                {"step_metric": torch.tensor(-1), "shared_metric": 100}, logger=False, prog_bar=True
            )
            return out

        def on_train_epoch_end(self) -> None:
            epoch = self.current_epoch
            self.log_dict(
                {f"epoch_metric_{epoch}": torch.tensor(epoch), "shared_metric": 111},
                logger=False,
                prog_bar=True,
            )

    trainer = L.Trainer(default_root_dir=outdir, max_epochs=3, overfit_batches=2, logger=False, **QUIET)
    trainer.fit(Model())
    return {k: float(v) for k, v in sorted(trainer.progress_bar_metrics.items())}


def _fit_hooks(outdir: str, manual: bool, override_model_train: bool) -> list[Any]:
    recorder = Recorder()
    model = HookedModel(recorder, manual=manual)
    if not override_model_train:
        model.on_validation_model_train = None
    trainer = _trainer(outdir, recorder, max_epochs=1, limit_train_batches=2, limit_val_batches=2)
    trainer.fit(model)
    return [is_overridden("on_validation_model_train", model), recorder.calls]


def fit_hooks_automatic(outdir: str) -> dict[str, Any]:
    return {str(o): _fit_hooks(os.path.join(outdir, str(o)), False, o) for o in (True, False)}


def fit_hooks_manual(outdir: str) -> dict[str, Any]:
    return {str(o): _fit_hooks(os.path.join(outdir, str(o)), True, o) for o in (True, False)}


def _resume_hooks(outdir: str, first: dict[str, Any], second: dict[str, Any]) -> list[Any]:
    trainer = _trainer(outdir, Recorder(), limit_val_batches=0, **first)
    trainer.fit(BoringModel())
    path = trainer.checkpoint_callback.best_model_path
    recorder = Recorder()
    model = HookedModel(recorder)
    trainer = _trainer(outdir, recorder, limit_val_batches=0, **second)
    trainer.fit(model, ckpt_path=path)
    return recorder.calls


def fit_no_val_resume_max_epochs(outdir: str) -> list[Any]:
    return _resume_hooks(
        outdir, {"max_epochs": 1, "limit_train_batches": 2}, {"max_epochs": 2, "limit_train_batches": 2}
    )


def fit_no_val_resume_max_steps(outdir: str) -> list[Any]:
    return _resume_hooks(outdir, {"max_steps": 1}, {"max_steps": 3})


def eval_hooks(outdir: str) -> dict[str, Any]:
    out = {}
    for verb, noun in (("validate", "validation"), ("test", "test")):
        for batches in (0, 2):
            for override in (True, False):
                recorder = Recorder()
                model = HookedModel(recorder)
                if not override:
                    setattr(model, f"on_{noun}_model_train", None)
                trainer = _trainer(
                    outdir, recorder, max_epochs=1, limit_val_batches=batches, limit_test_batches=batches
                )
                getattr(trainer, verb)(model, verbose=False)
                out[f"{verb}-{batches}-{override}"] = recorder.calls
    return out


def predict_hooks(outdir: str) -> list[Any]:
    recorder = Recorder()
    model = HookedModel(recorder)
    trainer = _trainer(outdir, recorder, limit_predict_batches=2)
    trainer.predict(model)
    return recorder.calls


def different_argument_names(outdir: str) -> dict[str, Any]:
    seen: list[list[Any]] = []

    class Model(BoringModel):
        def note(self, where: str, x: Any, idx: Any, *rest: Any) -> None:
            seen.append([where, list(x.shape), type(idx).__name__, [type(r).__name__ for r in rest]])

        def training_step(self, x1: Any, batch_nb1: int) -> Any:
            self.note("train", x1, batch_nb1)
            return super().training_step(x1, batch_nb1)

        def validation_step(self, x2: Any, batch_nb2: int) -> Any:
            self.note("val", x2, batch_nb2)
            return super().validation_step(x2, batch_nb2)

        def test_step(self, x3: Any, batch_nb3: int, dataloader_idx: int) -> Any:
            self.note("test", x3, batch_nb3, dataloader_idx)
            return super().test_step(x3, batch_nb3)

        def predict_step(self, x4: Any, batch_nb4: int, dataloader_idx: int) -> Any:
            self.note("predict", x4, batch_nb4, dataloader_idx)
            return super().predict_step(x4, batch_nb4, dataloader_idx)

        def test_dataloader(self) -> list[DataLoader]:
            return [DataLoader(RandomDataset(32, 64)), DataLoader(RandomDataset(32, 64))]

        def predict_dataloader(self) -> list[DataLoader]:
            return [DataLoader(RandomDataset(32, 64)), DataLoader(RandomDataset(32, 64))]

    model = Model()
    trainer = L.Trainer(default_root_dir=outdir, fast_dev_run=5, logger=False, **QUIET)
    trainer.fit(model)
    trainer.test(model, verbose=False)
    preds = trainer.predict(model)
    return {"seen": seen, "preds": [len(p) for p in preds]}


def datamodule_hooks(outdir: str) -> dict[str, Any]:
    class DM(BoringDataModule):
        def prepare_data(self) -> None: ...

    trainer = L.Trainer(
        default_root_dir=outdir,
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=2,
        limit_test_batches=2,
        limit_predict_batches=2,
        reload_dataloaders_every_n_epochs=1,
        logger=False,
        **QUIET,
    )
    out = {}
    for fn in ("fit", "validate", "test", "predict"):
        recorder = Recorder()
        dm = recorder.attach(DM(), "", DATAMODULE_HOOKS)
        kwargs = {} if fn in ("fit", "predict") else {"verbose": False}
        getattr(trainer, fn)(BoringModel(), datamodule=dm, **kwargs)
        out[fn] = recorder.calls
    return out


class _StatefulDM(BoringDataModule):
    loaded: list[Any] = []  # noqa: RUF012  (what load_state_dict received, in order)

    def state_dict(self) -> dict[str, Any]:
        return {"foo": "bar"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded.append(["load_state_dict", [simple(state)]])


def load_from_checkpoint_hooks(outdir: str) -> dict[str, Any]:
    out = {}
    for override in (True, False):
        cls = type(f"Model{override}", (HookedModel,), {} if override else {"configure_model": None})
        model, dm = cls(), _StatefulDM()
        trainer = L.Trainer(default_root_dir=outdir, max_steps=1, limit_val_batches=0, logger=False, **QUIET)
        trainer.fit(model, datamodule=dm)
        path = os.path.join(outdir, f"file{override}.ckpt")
        trainer.save_checkpoint(path)
        recorder = Recorder()

        class Loaded(cls):  # the recorders go on the instance the classmethod builds
            def __init__(self, recorder: Recorder = recorder) -> None:
                super().__init__(recorder)

        Loaded.load_from_checkpoint(path)
        _StatefulDM.loaded.clear()
        _StatefulDM.load_from_checkpoint(path)
        out[str(override)] = {"module": recorder.calls, "datamodule": list(_StatefulDM.loaded)}
    return out


def train_eval_mode_restored(outdir: str) -> dict[str, Any]:
    seen: list[list[Any]] = []

    class Mixed(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.frozen = nn.Linear(2, 2)
            self.frozen.eval()
            self.frozen.requires_grad_(False)

        def note(self, where: str) -> None:
            flags = [self.layer.weight.requires_grad, self.layer.training]
            seen.append([where, *flags, self.frozen.training, self.frozen.weight.requires_grad])

        def training_step(self, *args: Any) -> Any:
            self.note("train")
            return super().training_step(*args)

        def validation_step(self, *args: Any) -> Any:
            self.note("val")
            return super().validation_step(*args)

        def test_step(self, *args: Any) -> Any:
            self.note("test")
            return super().test_step(*args)

        def predict_step(self, *args: Any) -> Any:
            self.note("predict")
            return super().predict_step(*args)

    model = Mixed()
    trainer = L.Trainer(
        default_root_dir=outdir,
        max_epochs=1,
        val_check_interval=1,
        limit_train_batches=3,
        limit_val_batches=2,
        limit_test_batches=2,
        limit_predict_batches=2,
        enable_checkpointing=False,
        logger=False,
        **QUIET,
    )
    after = []
    for fn in ("fit", "validate", "test", "predict"):
        getattr(trainer, fn)(model, **({"verbose": False} if fn in ("validate", "test") else {}))
        after.append([model.training, model.layer.training, model.frozen.training])
    return {"seen": seen, "after": after}


# ---- core/test_lightning_module.py ----------------------------------------------------------------
def module_properties(outdir: str) -> dict[str, Any]:
    model = BoringModel()
    before = [
        model.current_epoch,
        model.global_step,
        model.global_rank,
        model.local_rank,
        model.logger,
        model.loggers,
    ]
    try:
        _ = model.trainer
        unattached = "none"
    except RuntimeError:
        unattached = "raised"
    inner = L.LightningModule()
    model.inner = inner
    csv_a, csv_b = CSVLogger(outdir, name="a"), CSVLogger(outdir, name="b")
    trainer = L.Trainer(default_root_dir=outdir, max_steps=3, limit_val_batches=0, logger=csv_a, **QUIET)
    model.trainer = trainer
    attached = [model.logger is csv_a, model.loggers == [csv_a], inner.trainer is trainer]
    trainer.fit(model)
    during = [model.current_epoch, model.global_step, model.global_rank, model.local_rank]
    two = L.Trainer(default_root_dir=outdir, logger=[csv_a, csv_b], **QUIET)
    model.trainer = two
    return {
        "before": before,
        "unattached_trainer": unattached,
        "attached": attached,
        "after_fit": during,
        "two_loggers": [model.logger is csv_a, model.loggers == [csv_a, csv_b]],
        "not_abstract": isinstance(L.LightningModule(), nn.Module),
    }


def _requires_grad(model: nn.Module) -> dict[str, bool]:
    return {name: p.requires_grad for name, p in model.named_parameters()}


def toggle_one_optimizer(outdir: str) -> dict[str, Any]:
    model = BoringModel()
    trainer = L.Trainer(default_root_dir=outdir, max_steps=1, limit_val_batches=0, logger=False, **QUIET)
    trainer.fit(model)
    opt = model.optimizers()
    states = [_requires_grad(model)]
    model.toggle_optimizer(opt)
    states.append(_requires_grad(model))
    model.untoggle_optimizer(opt)
    states.append(_requires_grad(model))
    with model.toggled_optimizer(opt):
        states.append(_requires_grad(model))
    states.append(_requires_grad(model))
    return {"states": states}


class _Layers(BoringModel):
    """Three stacks, some weights frozen, optimizers sharing parameters (or not)."""

    def __init__(self, shared: bool) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.shared = shared
        self.layer_1 = nn.Sequential(
            nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32)
        )
        self.layer_2 = nn.Sequential(
            nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2)
        )
        self.layer_3 = nn.Sequential(
            nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2)
        )
        for layer, idx in (
            (self.layer_1, 2),
            (self.layer_1, 4),
            (self.layer_2, 1),
            (self.layer_2, 3),
            (self.layer_3, 1),
            (self.layer_3, 5),
        ):
            layer[idx].weight.requires_grad = False
        self.seen: list[Any] = []

    def forward(self, x: Any) -> Any:
        return self.layer_2(self.layer_1(x)) + self.layer_3(self.layer_1(x))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        for opt in self.optimizers():
            self.toggle_optimizer(opt)
            loss = self.step(batch)
            opt.zero_grad()
            self.manual_backward(loss)
            if batch_idx == 0:
                self.seen.append(_requires_grad(self))
            opt.step()
            self.untoggle_optimizer(opt)
        if batch_idx == 0:
            self.seen.append(_requires_grad(self))

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        l1, l2, l3 = (list(m.parameters()) for m in (self.layer_1, self.layer_2, self.layer_3))
        if not self.shared:
            return [torch.optim.SGD(l1, lr=0.1), torch.optim.Adam(l2, lr=0.1)]
        return [
            torch.optim.SGD(l1 + l2, lr=0.1),
            torch.optim.Adam(l2 + l3, lr=0.1),
            torch.optim.SGD(l3 + l1, lr=0.1),
        ]


def toggle_optimizers(outdir: str) -> dict[str, Any]:
    out = {}
    for shared in (False, True):
        model = _Layers(shared)
        trainer = L.Trainer(
            default_root_dir=outdir,
            max_epochs=1,
            limit_train_batches=8,
            limit_val_batches=0,
            logger=False,
            **QUIET,
        )
        trainer.fit(model)
        out[str(shared)] = {"seen": model.seen, "global_step": trainer.global_step}
    return out


def configure_gradient_clipping_hook(outdir: str) -> dict[str, Any]:
    class Model(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.args: list[Any] = []

        def configure_gradient_clipping(
            self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
        ) -> None:
            self.args.append(
                [
                    gradient_clip_val,
                    gradient_clip_algorithm,
                    self.trainer.gradient_clip_val,
                    self.trainer.gradient_clip_algorithm,
                ]
            )
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad.clamp_(min=0, max=1e-2)

        def on_train_batch_end(self, *args: Any) -> None:
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            self.args.append([float(min(g.min() for g in grads)), float(max(g.max() for g in grads))])

    model = Model()
    trainer = L.Trainer(
        default_root_dir=outdir,
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=0,
        gradient_clip_val=1e-4,
        logger=False,
        **QUIET,
    )
    trainer.fit(model)
    return {"args": model.args}


def configure_gradient_clipping_conflicts(outdir: str) -> dict[str, Any]:
    out = {}
    for trainer_kwargs, clip_kwargs in (
        ({"gradient_clip_val": 1e-4}, {"gradient_clip_val": 1e-2}),
        ({"gradient_clip_algorithm": "norm"}, {"gradient_clip_algorithm": "value"}),
        ({"gradient_clip_val": 1e-4}, {"gradient_clip_val": 1e-4}),
    ):

        class Model(BoringModel):
            clip = clip_kwargs

            def configure_gradient_clipping(
                self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
            ) -> None:
                self.clip_gradients(optimizer, **self.clip)

        trainer = L.Trainer(
            default_root_dir=outdir,
            max_epochs=1,
            limit_train_batches=2,
            limit_val_batches=0,
            logger=False,
            **QUIET,
            **trainer_kwargs,
        )
        try:
            trainer.fit(Model())
            out[f"{trainer_kwargs}-{clip_kwargs}"] = "ran"
        except Exception:
            out[f"{trainer_kwargs}-{clip_kwargs}"] = "raised"
    return out


def device_placement(outdir: str) -> dict[str, Any]:
    model = BoringModel()
    trainer = L.Trainer(default_root_dir=outdir, fast_dev_run=True, logger=False, **QUIET)
    trainer.fit(model)
    devices = [str(model.device)]
    trainer.test(model, verbose=False)
    devices.append(str(model.device))
    trainer.predict(model, dataloaders=model.train_dataloader())
    devices.append(str(model.device))
    return {"devices": devices, "params": sorted({str(p.device) for p in model.parameters()})}


SECTIONS = [
    on_before_zero_grad_count,
    epoch_end_progress_bar_metrics,
    fit_hooks_automatic,
    fit_hooks_manual,
    fit_no_val_resume_max_epochs,
    fit_no_val_resume_max_steps,
    eval_hooks,
    predict_hooks,
    different_argument_names,
    datamodule_hooks,
    load_from_checkpoint_hooks,
    train_eval_mode_restored,
    module_properties,
    toggle_one_optimizer,
    toggle_optimizers,
    configure_gradient_clipping_hook,
    configure_gradient_clipping_conflicts,
    device_placement,
]

if __name__ == "__main__":
    run_sections(sys.argv[1], SECTIONS, L.seed_everything)
