"""What Lightning 2.6's ``tests_pytorch/loops/*`` promise about the fit, evaluation and prediction
loops, as scenarios of our own: what ``training_step`` may return (a loss, a dict, None) and what the
batch-end hooks receive, ``on_train_batch_start`` returning -1, ``should_stop`` mid-epoch and against
``min_epochs``/``min_steps``, seeding, ``dataloader_idx`` in step and batch hooks with one or several
loaders, steps without ``batch_idx``, stored predictions, closures and ``optimizer_step`` overrides,
and resuming (the counters and weights of a resumed run against an uninterrupted one).
One section per promise (``run_sections``). Run: ``python loops_program.py OUTDIR``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from observe import run_sections
from torch.utils.data import DataLoader
from torch.utils.data.dataloader import default_collate

QUIET = {"accelerator": "cpu", "devices": 1, "enable_progress_bar": False, "enable_model_summary": False}


def trainer(outdir: str, **kwargs: Any) -> L.Trainer:
    options = {"logger": False, "enable_checkpointing": False, **QUIET, **kwargs}
    return L.Trainer(default_root_dir=outdir, **options)


def outcome(run: Any) -> str:
    try:
        run()
    except Exception:
        return "raised"
    return "ran"


def kind(value: Any) -> Any:
    """What a hook received, as JSON: None, a dict's keys, or the type's name."""
    if value is None:
        return None
    if isinstance(value, dict):
        return sorted(value)
    return type(value).__name__


# ---- test_training_loop.py ----------------------------------------------------------------------
def outputs_format(outdir: str) -> list[Any]:
    seen: list[Any] = []

    class Model(BoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            out = super().training_step(batch, batch_idx)
            self.log("foo", 123)
            out["foo"] = 123
            return out

        def on_train_batch_end(self, outputs: Any, *_: Any) -> None:
            seen.append([kind(outputs), outputs["foo"]])

    trainer(outdir, max_epochs=1, limit_val_batches=1, limit_train_batches=2).fit(Model())
    return seen


def training_starts_with_seed(outdir: str) -> dict[str, Any]:
    class Seeded(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[torch.Tensor] = []

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            self.seen.append(batch.view(-1)[:4])
            return super().training_step(batch, batch_idx)

    def run(sanity: int) -> list[float]:
        model = Seeded()
        trainer(outdir, max_steps=2, num_sanity_val_steps=sanity).fit(model)
        return torch.cat(model.seen).tolist()

    L.seed_everything(123)
    once = [run(0), run(2)]
    L.seed_everything(123)
    first = run(0)
    L.seed_everything(123)
    return {"seeded_once": once, "seeded_each": [first, run(2)]}


def batch_start_minus_one(outdir: str) -> dict[str, Any]:
    out = {}
    for max_epochs, stop_at in ((2, 5), (3, 8), (4, 12)):

        class Model(BoringModel):
            def on_train_batch_start(self, batch: Any, batch_idx: int, stop_at: int = stop_at) -> Any:
                return -1 if batch_idx == stop_at else None

        t = trainer(outdir, max_epochs=max_epochs, limit_train_batches=10, limit_val_batches=1)
        t.fit(Model())
        out[f"{max_epochs}-{stop_at}"] = {
            "global_step": t.global_step,
            "epoch": t.current_epoch,
            "is_last_batch": t.is_last_batch,
            "lr": [g["lr"] for g in t.optimizers[0].param_groups],
        }
    return out


def should_stop_mid_epoch(outdir: str) -> dict[str, Any]:
    class Model(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.validated_at: list[Any] = []

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if batch_idx == 4:
                self.trainer.should_stop = True
            return super().training_step(batch, batch_idx)

        def validation_step(self, *args: Any) -> Any:
            self.validated_at.append([self.trainer.current_epoch, self.trainer.global_step])
            return super().validation_step(*args)

    model = Model()
    t = trainer(outdir, max_epochs=1, limit_train_batches=10, limit_val_batches=1, num_sanity_val_steps=0)
    t.fit(model)
    return {"epoch": t.current_epoch, "step": t.global_step, "validated_at": model.validated_at}


def eval_mode_warning(outdir: str) -> dict[str, Any]:
    import warnings

    out = {}
    for frozen in (True, False):
        model = BoringModel()
        if frozen:
            model.some_eval_module = torch.nn.Linear(32, 16)
            model.some_eval_module.eval()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer(outdir, max_epochs=1, limit_train_batches=1, limit_val_batches=1).fit(model)
        out[str(frozen)] = any("eval mode" in str(w.message) for w in caught)
    return out


def val_check_interval_without_validation(outdir: str) -> dict[str, Any]:
    out = {}
    for limit in (0, 0.0):
        t = trainer(
            outdir, max_epochs=1, limit_train_batches=5, val_check_interval=10, limit_val_batches=limit
        )
        out[str(limit)] = outcome(lambda t=t: t.fit(BoringModel()))
    return out


# ---- test_training_loop_flow_scalar.py / _flow_dict.py -------------------------------------------
def training_step_flows(outdir: str) -> dict[str, Any]:
    """What training_step returns (a tensor, a dict with extras) and what on_train_batch_end and
    on_train_epoch_end see of it."""
    out = {}
    for form in ("scalar", "dict"):
        seen: list[Any] = []

        class Model(BoringModel):
            def training_step(self, batch: Any, batch_idx: int, form: str = form) -> Any:
                loss = self.step(batch)
                return (
                    loss if form == "scalar" else {"loss": loss, "random_things": [1, "a", torch.tensor(2)]}
                )

            def on_train_batch_end(
                self, outputs: Any, batch: Any, batch_idx: int, seen: list[Any] = seen
            ) -> None:
                seen.append(["batch_end", batch_idx, kind(outputs)])

            def on_train_epoch_end(self, seen: list[Any] = seen) -> None:
                seen.append(["epoch_end", self.current_epoch])

        model = Model()
        before = model.layer.weight.clone()
        t = trainer(outdir, limit_train_batches=2, limit_val_batches=2, max_epochs=2, log_every_n_steps=1)
        t.fit(model)
        out[form] = {
            "seen": seen,
            "step": t.global_step,
            "trained": not torch.equal(before, model.layer.weight),
        }
    return out


def training_step_returns_none(outdir: str) -> dict[str, Any]:
    import warnings

    out = {}
    for manual in (False, True):

        class Model(BoringModel):
            def training_step(self, batch: Any) -> None:
                self.log("a", self.step(batch), on_step=True, on_epoch=True)

            def validation_step(self, batch: Any, batch_idx: int) -> None:
                self.validated = True

        model = Model()
        model.automatic_optimization = not manual
        before = model.layer.weight.clone()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t = trainer(outdir, fast_dev_run=2)
            t.fit(model)
        out[str(manual)] = {
            "warned": any("None" in str(w.message) for w in caught),
            "validated": getattr(model, "validated", False),
            "step": t.global_step,
            "changed": not torch.equal(before, model.layer.weight),
            "logged": sorted(t.callback_metrics),
        }
    return out


def training_step_none_when_even(outdir: str) -> dict[str, Any]:
    seen: list[Any] = []

    class Model(BoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = self.step(batch)
            self.log("a", loss, on_step=True, on_epoch=True)
            return loss if batch_idx % 2 else None

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            seen.append([batch_idx, kind(outputs), self.global_step])

    model = Model()
    t = trainer(outdir, limit_train_batches=4, limit_val_batches=1, max_epochs=4)
    t.fit(model)
    return {
        "seen": seen,
        "step": t.global_step,
        "weight": model.layer.weight[0, :3].tolist(),
        "a": float(t.callback_metrics["a"]),
    }


def none_batches(outdir: str) -> dict[str, Any]:
    seen: list[Any] = []

    class Model(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.counter = 0

        def collate(self, batch: Any) -> Any:
            result = None if self.counter % 2 == 0 else default_collate(batch)
            self.counter += 1
            return result

        def train_dataloader(self) -> DataLoader:
            return DataLoader(RandomDataset(32, 4), collate_fn=self.collate)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if batch is None:
                return None
            return super().training_step(batch, batch_idx)

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            seen.append([batch_idx, kind(outputs), batch is None])

    t = trainer(outdir, limit_val_batches=1, max_epochs=2)
    t.fit(Model())
    return {"seen": seen, "step": t.global_step}


# ---- test_training_epoch_loop.py ----------------------------------------------------------------
def should_stop_against_minimums(outdir: str) -> dict[str, Any]:
    out = {}
    for min_epochs, min_steps in ((None, None), (2, None), (None, 6), (1, 3)):

        class Model(BoringModel):
            def __init__(self) -> None:
                super().__init__()
                self.validations: list[int] = []

            def training_step(self, batch: Any, batch_idx: int) -> Any:
                self.trainer.should_stop = True
                return super().training_step(batch, batch_idx)

            def on_validation_start(self) -> None:
                if not self.trainer.sanity_checking:
                    self.validations.append(self.global_step)

        model = Model()
        t = trainer(
            outdir,
            min_epochs=min_epochs,
            min_steps=min_steps,
            max_epochs=10,
            limit_train_batches=4,
            limit_val_batches=1,
        )
        t.fit(model)
        out[f"{min_epochs}-{min_steps}"] = {
            "step": t.global_step,
            "epoch": t.current_epoch,
            "validations": model.validations,
        }
    return out


def no_val_after_resume_at_epoch_end(outdir: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    dirpath = os.path.join(outdir, "ckpts")
    for name, max_epochs, ckpt in (("first", 1, None), ("resumed", 2, "last")):

        class Model(BoringModel):
            def __init__(self) -> None:
                super().__init__()
                self.validations: list[Any] = []

            def on_validation_start(self) -> None:
                self.validations.append([self.current_epoch, self.global_step, self.trainer.sanity_checking])

        model = Model()
        t = L.Trainer(
            default_root_dir=outdir,
            max_epochs=max_epochs,
            limit_train_batches=3,
            limit_val_batches=1,
            logger=False,
            callbacks=[ModelCheckpoint(dirpath=dirpath, save_last=True)],
            **QUIET,
        )
        t.fit(model, ckpt_path=ckpt)
        out[name] = {"validations": model.validations, "step": t.global_step, "epoch": t.current_epoch}
    return out


def resume_mid_epoch(outdir: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    dirpath = os.path.join(outdir, "ckpts")
    for name, max_steps, ckpt in (("first", 3, None), ("resumed", 8, "last")):

        class Model(BoringModel):
            def __init__(self) -> None:
                super().__init__()
                self.batches: list[Any] = []

            def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
                self.batches.append([self.current_epoch, batch_idx, self.global_step])

        model = Model()
        t = L.Trainer(
            default_root_dir=outdir,
            max_steps=max_steps,
            limit_train_batches=5,
            limit_val_batches=0,
            logger=False,
            callbacks=[ModelCheckpoint(dirpath=dirpath, save_last=True)],
            **QUIET,
        )
        t.fit(model, ckpt_path=ckpt)
        out[name] = {"batches": model.batches, "step": t.global_step, "epoch": t.current_epoch}
    return out


# ---- test_loops.py: restarting -------------------------------------------------------------------
def restart_parity(outdir: str) -> dict[str, Any]:
    """An uninterrupted run and one stopped at an epoch end then resumed from `last` end with the
    same weights, steps and epochs (with and without validation)."""
    out = {}
    for val in (0, 2):

        def run(max_epochs: int, ckpt: Any, where: str, val: int = val) -> Any:
            L.seed_everything(7)
            model = BoringModel()
            t = L.Trainer(
                default_root_dir=where,
                max_epochs=max_epochs,
                limit_train_batches=4,
                limit_val_batches=val,
                logger=False,
                callbacks=[ModelCheckpoint(dirpath=where, save_last=True)],
                **QUIET,
            )
            t.fit(model, ckpt_path=ckpt)
            return model.layer.weight.detach().clone(), t.global_step, t.current_epoch

        full_w, full_step, full_epoch = run(4, None, os.path.join(outdir, f"full{val}"))
        split = os.path.join(outdir, f"split{val}")
        run(2, None, split)
        res_w, res_step, res_epoch = run(4, "last", split)
        out[str(val)] = {
            "full": [full_step, full_epoch],
            "resumed": [res_step, res_epoch],
            "same_weights": torch.allclose(full_w, res_w),
            "weight": full_w[0, :3].tolist(),
        }
    return out


def fit_fails_during_validation(outdir: str) -> dict[str, Any]:
    class Fail(BoringModel):
        def validation_step(self, batch: Any, batch_idx: int) -> Any:
            if self.current_epoch == 1 and batch_idx == 1 and not self.trainer.sanity_checking:
                raise RuntimeError("stop here")
            return super().validation_step(batch, batch_idx)

    model = Fail()
    t = trainer(outdir, max_epochs=3, limit_train_batches=3, limit_val_batches=3)
    result = outcome(lambda: t.fit(model))
    return {
        "outcome": result,
        "step": t.global_step,
        "epoch": t.current_epoch,
        "status": str(getattr(t.state.status, "value", t.state.status)),
        "training": model.training,
    }


# ---- test_evaluation_loop.py / test_prediction_loop.py / test_evaluation_loop_flow.py -------------
def dataloader_idx_in_hooks(outdir: str) -> dict[str, Any]:
    """dataloader_idx in step / batch-hook signatures with one or two loaders: refused where
    Lightning refuses it, accepted with a default or *args."""

    def run(stage: str, hook: str, signature: str, loaders: int) -> str:
        params = {
            "extra": "dataloader_idx",
            "default": "dataloader_idx=0",
            "other_name": "dl_idx",
            "none": "",
            "varargs": "*_",
            "kwargs": "**_",
        }[signature]
        head = "outputs, batch, batch_idx" if hook.endswith("_end") else "batch, batch_idx"
        namespace: dict[str, Any] = {}
        exec(f"def h(self, {head}{', ' + params if params else ''}):\n    return None\n", namespace)  # noqa: S102
        name = {"validate": "val", "test": "test", "predict": "predict"}[stage]

        def loaders_fn(self: Any, n: int = loaders) -> Any:
            return (
                [DataLoader(RandomDataset(32, 4)) for _ in range(n)]
                if n > 1
                else DataLoader(RandomDataset(32, 4))
            )

        cls = type("Model", (BoringModel,), {hook: namespace["h"], f"{name}_dataloader": loaders_fn})
        t = trainer(outdir, fast_dev_run=True)
        return outcome(lambda: getattr(t, stage)(cls(), **({} if stage == "predict" else {"verbose": False})))

    out = {}
    for stage, noun in (("validate", "validation"), ("test", "test"), ("predict", "predict")):
        for hook in (f"{noun}_step", f"on_{noun}_batch_start", f"on_{noun}_batch_end"):
            for signature, loaders in (
                ("extra", 1),
                ("default", 1),
                ("other_name", 1),
                ("none", 2),
                ("varargs", 2),
                ("kwargs", 2),
            ):
                out[f"{stage}.{hook}.{signature}.{loaders}"] = run(stage, hook, signature, loaders)
    return out


def steps_without_batch_idx(outdir: str) -> dict[str, Any]:
    seen: list[Any] = []

    class Model(BoringModel):
        def validation_step(self, batch: Any) -> None:
            seen.append("val")

        def test_step(self, batch: Any) -> None:
            seen.append("test")

        def predict_step(self, batch: Any) -> Any:
            seen.append("predict")
            return batch.sum()

    t = trainer(outdir, fast_dev_run=2)
    t.validate(Model(), verbose=False)
    t.test(Model(), verbose=False)
    return {"seen": seen, "predictions": len(t.predict(Model()))}


def stored_predictions(outdir: str) -> dict[str, Any]:
    class Model(BoringModel):
        def predict_step(self, batch: Any, batch_idx: int) -> int:
            return batch_idx

    t = trainer(outdir, limit_predict_batches=2)
    kept = t.predict(Model(), return_predictions=True)
    dropped = trainer(outdir, limit_predict_batches=2).predict(Model(), return_predictions=False)
    return {"kept": kept, "dropped": dropped}


def sampler_set_epoch(outdir: str) -> dict[str, Any]:
    calls: list[Any] = []

    class Sampler(torch.utils.data.SequentialSampler):
        def set_epoch(self, epoch: int) -> None:
            calls.append([self.name, epoch])

    def loader(name: str) -> DataLoader:
        data = RandomDataset(32, 4)
        sampler = Sampler(data)
        sampler.name = name
        return DataLoader(data, sampler=sampler)

    class Model(BoringModel):
        def train_dataloader(self) -> DataLoader:
            return loader("train")

        def val_dataloader(self) -> DataLoader:
            return loader("val")

        def test_dataloader(self) -> DataLoader:
            return loader("test")

        def predict_dataloader(self) -> DataLoader:
            return loader("predict")

    model = Model()
    t = trainer(
        outdir,
        max_epochs=2,
        limit_train_batches=1,
        limit_val_batches=1,
        limit_test_batches=1,
        limit_predict_batches=1,
        num_sanity_val_steps=0,
    )
    t.fit(model)
    t.test(model, verbose=False)
    t.predict(model)
    return {"calls": calls}


def eval_epoch_metrics_before_end(outdir: str) -> dict[str, Any]:
    seen: list[Any] = []

    class Model(BoringModel):
        def validation_step(self, batch: Any, batch_idx: int) -> Any:
            self.log("v", float(batch_idx))
            return super().validation_step(batch, batch_idx)

        def on_validation_epoch_end(self) -> None:
            seen.append(["epoch_end", sorted(self.trainer.callback_metrics)])

        def on_validation_end(self) -> None:
            seen.append(["end", {k: float(v) for k, v in sorted(self.trainer.callback_metrics.items())}])

    t = trainer(outdir, limit_val_batches=3)
    t.validate(Model(), verbose=False)
    return {"seen": seen}


def eval_step_flow(outdir: str) -> dict[str, Any]:
    seen: list[Any] = []

    class Model(BoringModel):
        def validation_step(self, batch: Any, batch_idx: int) -> Any:
            out = {"something": "random"} if batch_idx % 2 else torch.tensor(float(batch_idx))
            return out

        def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            seen.append(
                [batch_idx, kind(outputs) if not isinstance(outputs, torch.Tensor) else float(outputs)]
            )

        def on_validation_epoch_end(self) -> None:
            seen.append(["epoch_end", self.current_epoch])

    model = Model()
    before = model.layer.weight.clone()
    t = trainer(outdir, limit_train_batches=2, limit_val_batches=2, max_epochs=2, num_sanity_val_steps=0)
    t.fit(model)
    return {"seen": seen, "trained": not torch.equal(before, model.layer.weight), "step": t.global_step}


# ---- loops/optimization: closures and optimizer_step overrides ------------------------------------
def optimizer_step_without_closure(outdir: str) -> dict[str, Any]:
    class Skips(BoringModel):
        def optimizer_step(
            self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None
        ) -> None:
            optimizer.step()  # the closure (training_step, backward) never runs

    class NoGrad(BoringModel):
        def configure_optimizers(self) -> Any:
            class NoGradSGD(torch.optim.SGD):
                @torch.no_grad()
                def step(self, closure: Any = None) -> Any:
                    if closure is not None:
                        with torch.enable_grad():
                            closure()
                    return super().step()

            return NoGradSGD(self.parameters(), lr=0.1)

    model = NoGrad()
    before = model.layer.weight.clone()
    result = outcome(lambda: trainer(outdir, max_steps=2, limit_val_batches=0).fit(model))
    return {
        "without_closure": outcome(lambda: trainer(outdir, max_steps=2, limit_val_batches=0).fit(Skips())),
        "no_grad_optimizer": result,
        "no_grad_trained": not torch.equal(before, model.layer.weight),
    }


def invalid_training_step_output(outdir: str) -> dict[str, Any]:
    out = {}
    for name, make in (
        ("dict_without_loss", lambda loss: {"x": loss}),
        ("string", lambda loss: "loss"),
        ("int", lambda loss: 1),
        ("non_scalar", lambda loss: loss.repeat(2)),
    ):

        class Model(BoringModel):
            def training_step(self, batch: Any, batch_idx: int, make: Any = make) -> Any:
                return make(self.step(batch))

        out[name] = outcome(lambda: trainer(outdir, max_steps=1, limit_val_batches=0).fit(Model()))
    return out


SECTIONS = [
    outputs_format,
    training_starts_with_seed,
    batch_start_minus_one,
    should_stop_mid_epoch,
    eval_mode_warning,
    val_check_interval_without_validation,
    training_step_flows,
    training_step_returns_none,
    training_step_none_when_even,
    none_batches,
    should_stop_against_minimums,
    no_val_after_resume_at_epoch_end,
    resume_mid_epoch,
    restart_parity,
    fit_fails_during_validation,
    dataloader_idx_in_hooks,
    steps_without_batch_idx,
    stored_predictions,
    sampler_set_epoch,
    eval_epoch_metrics_before_end,
    eval_step_flow,
    optimizer_step_without_closure,
    invalid_training_step_output,
]

if __name__ == "__main__":
    run_sections(sys.argv[1], SECTIONS, L.seed_everything)
