"""What Lightning 2.6's ``tests_pytorch/trainer/optimization/*`` promise, as scenarios of our own:
how many backward passes a step makes (accumulation, closures), the forms ``configure_optimizers``
may return and the errors for the others, LR schedulers (intervals, frequencies, plateau monitors,
``strict``, custom schedulers and ``lr_scheduler_step``, their state when a checkpoint is saved),
multiple optimizers and manual optimization (closures, ``lr_schedulers()``, logging).
One section per promise (``run_sections``). Run: ``python optimization_program.py OUTDIR``.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel
from observe import run_sections
from torch import optim

QUIET = {"accelerator": "cpu", "devices": 1, "enable_progress_bar": False, "enable_model_summary": False}


def outcome(run: Any) -> str:
    """ "ran", "warned" (a RuntimeWarning or UserWarning from the framework) or "raised"."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            run()
        except Exception:
            return "raised"
    relevant = [w for w in caught if issubclass(w.category, RuntimeWarning | UserWarning)]
    return "warned" if relevant else "ran"


def trainer(outdir: str, **kwargs: Any) -> L.Trainer:
    options = {"logger": False, "enable_checkpointing": False, **QUIET, **kwargs}
    return L.Trainer(default_root_dir=outdir, **options)


class Counted(BoringModel):
    """Counts the backward passes through its layer (a module backward hook: real passes only)."""

    def __init__(self) -> None:
        super().__init__()
        self.backwards = 0
        self.layer.register_full_backward_hook(self._count)

    def _count(self, *_: Any) -> None:
        self.backwards += 1


def _lrs(opt: Any) -> list[float]:
    return [group["lr"] for group in opt.param_groups]


# ---- test_backward_calls.py ---------------------------------------------------------------------
def backward_count_simple(outdir: str) -> dict[str, Any]:
    out = {}
    for steps in (1, 2, 3):
        model = Counted()
        t = trainer(outdir, max_steps=steps)
        t.fit(model)
        fit_count, model.backwards = model.backwards, 0
        t.test(model, verbose=False)
        out[str(steps)] = [fit_count, model.backwards]
    return out


def backward_count_accumulation(outdir: str) -> dict[str, Any]:
    model = Counted()
    trainer(outdir, max_epochs=1, limit_train_batches=6, accumulate_grad_batches=2).fit(model)
    first, model.backwards = model.backwards, 0
    t = trainer(outdir, max_steps=6, accumulate_grad_batches=2)
    t.fit(model)
    return {"epoch_of_6": first, "six_steps": model.backwards, "global_step": t.global_step}


def backward_count_closure(outdir: str) -> dict[str, Any]:
    class LBFGSModel(Counted):
        def configure_optimizers(self) -> optim.Optimizer:
            return optim.LBFGS(self.parameters(), lr=0.1, max_iter=1)

    out = {}
    for accumulate in (1, 2):
        model = LBFGSModel()
        t = trainer(outdir, max_steps=5, accumulate_grad_batches=accumulate)
        t.fit(model)
        out[str(accumulate)] = [model.backwards, t.global_step]
    return out


# ---- test_multiple_optimizers.py ----------------------------------------------------------------
def multiple_optimizers_automatic_raises(outdir: str) -> dict[str, Any]:
    class OptimizerIdx(BoringModel):
        def training_step(self, batch: Any, batch_idx: int, optimizer_idx: int) -> Any:
            return super().training_step(batch, batch_idx)

    class TwoOptimizers(BoringModel):
        def configure_optimizers(self) -> Any:
            return optim.Adam(self.parameters()), optim.Adam(self.parameters())

    return {
        "optimizer_idx": outcome(lambda: trainer(outdir, max_steps=1).fit(OptimizerIdx())),
        "two_optimizers": outcome(lambda: trainer(outdir, max_steps=1).fit(TwoOptimizers())),
    }


class ManualTwo(Counted):
    """Two SGDs on the same layer stepped by hand; the second loss is backpropagated twice."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.grads_none: list[bool] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        opt_a, opt_b = self.optimizers()
        self.grads_none.append(self.layer.weight.grad is None)
        self.manual_backward(self.step(batch))
        opt_a.step()
        opt_a.zero_grad()
        self.grads_none.append(self.layer.weight.grad is None)
        loss = self.step(batch)
        self.manual_backward(loss, retain_graph=True)
        self.manual_backward(loss)
        opt_b.step()
        opt_b.zero_grad()
        self.grads_none.append(self.layer.weight.grad is None)
        return loss

    def configure_optimizers(self) -> Any:
        return optim.SGD(self.layer.parameters(), lr=0.1), optim.SGD(self.layer.parameters(), lr=0.1)


def multiple_optimizers_manual(outdir: str) -> dict[str, Any]:
    class Logs(ManualTwo):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = super().training_step(batch, batch_idx)
            self.log("a", loss, on_epoch=True)

    out = {}
    for name, cls in (("plain", ManualTwo), ("logs", Logs)):
        model = cls()
        t = trainer(outdir, limit_train_batches=2, limit_val_batches=0, max_epochs=1, log_every_n_steps=1)
        t.fit(model)
        out[name] = {
            "backwards": model.backwards,
            "global_step": t.global_step,
            "grads_none": model.grads_none,
            "logged": sorted(t.logged_metrics),
            "weight": model.layer.weight[0, :3].tolist(),
        }
    return out


# ---- test_manual_optimization.py ----------------------------------------------------------------
def manual_closure(outdir: str) -> dict[str, Any]:
    class Model(Counted):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.losses: list[float] = []
            self.changed: list[bool] = []

        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt = self.optimizers()

            def closure() -> None:
                losses = []
                for k in range(2):
                    loss = self.loss(F.dropout(self(F.dropout(batch, 0.1)), 0.1))
                    losses.append(loss)
                    self.manual_backward(loss, retain_graph=k == 0)
                loss = torch.stack(losses).mean()
                self.losses.append(float(loss))
                self.log("train_loss", loss, on_step=True, prog_bar=True, on_epoch=True)

            before = self.layer.weight.clone()
            opt.step(closure=closure)
            opt.zero_grad()
            self.changed.append(not torch.equal(before, self.layer.weight))

    model = Model()
    t = trainer(outdir, limit_train_batches=2, limit_val_batches=0, max_epochs=1, log_every_n_steps=1)
    t.fit(model)
    return {
        "backwards": model.backwards,
        "changed": model.changed,
        "losses": model.losses,
        "progress_bar": {k: float(v) for k, v in sorted(t.progress_bar_metrics.items())},
        "global_step": t.global_step,
    }


def manual_closure_frequencies(outdir: str) -> dict[str, Any]:
    class Model(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.steps: list[list[Any]] = []

        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt_gen, opt_dis = self.optimizers()

            def gen_closure() -> None:
                loss = self.loss(self(batch))
                self.log("loss_gen", loss, on_step=True, on_epoch=True)
                self.manual_backward(loss)

            def dis_closure() -> None:
                loss = self.loss(self(batch))
                self.log("loss_dis", loss, on_step=True, on_epoch=True)
                self.manual_backward(loss)

            gen_closure()
            if batch_idx % 2 == 0:
                opt_gen.step(closure=gen_closure)
                opt_gen.zero_grad()
                self.steps.append(["gen", batch_idx, self.global_step])
            if batch_idx % 4 == 0:
                opt_dis.step(closure=dis_closure)
                opt_dis.zero_grad()
                self.steps.append(["dis", batch_idx, self.global_step])

        def configure_optimizers(self) -> Any:
            return [optim.SGD(self.layer.parameters(), lr=0.1), optim.Adam(self.layer.parameters(), lr=0.001)]

    model = Model()
    model.val_dataloader = None
    t = trainer(outdir, limit_train_batches=8, limit_val_batches=2, max_epochs=1, log_every_n_steps=1)
    t.fit(model)
    return {"steps": model.steps, "global_step": t.global_step, "logged": sorted(t.logged_metrics)}


def manual_lr_schedulers(outdir: str) -> dict[str, Any]:
    class Model(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.same: list[bool] = []

        def training_step(self, batch: Any, batch_idx: int) -> None:
            s1, s2 = self.lr_schedulers()
            self.same.append(s1 is self.s1 and s2 is self.s2)

        def configure_optimizers(self) -> Any:
            o1, o2 = optim.SGD(self.parameters(), lr=0.1), optim.SGD(self.parameters(), lr=0.1)
            self.s1 = optim.lr_scheduler.StepLR(o1, step_size=1)
            self.s2 = optim.lr_scheduler.StepLR(o2, step_size=1)
            return [o1, o2], [self.s1, self.s2]

    model = Model()
    trainer(outdir, max_epochs=1, limit_train_batches=1, limit_val_batches=1).fit(model)
    return {"same": model.same, "last_epochs": [model.s1.last_epoch, model.s2.last_epoch]}


def manual_plateau(outdir: str) -> dict[str, Any]:
    out = {}
    for as_dict in (True, False):

        class Model(BoringModel):
            def __init__(self) -> None:
                super().__init__()
                self.automatic_optimization = False

            def training_step(self, batch: Any, batch_idx: int) -> None:
                pass

            def on_train_epoch_end(self) -> None:
                self.lr_schedulers().step(torch.tensor(0.0))

            def configure_optimizers(self, as_dict: bool = as_dict) -> Any:
                opt = optim.SGD(self.parameters(), lr=0.1)
                sched = optim.lr_scheduler.ReduceLROnPlateau(opt)
                if as_dict:
                    sched = {"scheduler": sched, "monitor": "train_loss", "interval": "step"}
                return [opt], [sched]

        t = trainer(outdir, max_epochs=1, limit_train_batches=1, limit_val_batches=1)
        result = outcome(lambda t=t: t.fit(Model()))
        out[str(as_dict)] = [result, t.lr_scheduler_configs[0].interval if t.lr_scheduler_configs else None]
    return out


def manual_scheduler_not_stepped(outdir: str) -> dict[str, Any]:
    class Model(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(self.step(batch))
            opt.step()

    model = Model()
    t = trainer(outdir, max_epochs=1, fast_dev_run=2)
    t.fit(model)
    sched = t.lr_scheduler_configs[0].scheduler
    return {"last_epoch": sched.last_epoch, "lr": _lrs(t.optimizers[0]), "global_step": t.global_step}


def manual_logging_two_optimizers(outdir: str) -> dict[str, Any]:
    class Model(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            for name, opt in zip(("loss_d", "loss_g"), self.optimizers(), strict=True):
                self.toggle_optimizer(opt)
                loss = self.step(batch)
                self.log(name, loss, prog_bar=True)
                opt.zero_grad()
                self.manual_backward(loss)
                opt.step()
                self.untoggle_optimizer(opt)

        def configure_optimizers(self) -> Any:
            return optim.SGD(self.layer.parameters(), lr=0.1), optim.SGD(self.layer.parameters(), lr=0.1)

    model = Model()
    model.val_dataloader = None
    t = trainer(outdir, limit_train_batches=2, limit_val_batches=2, max_epochs=1, log_every_n_steps=1)
    t.fit(model)
    return {"logged": sorted(t.logged_metrics), "progress_bar": sorted(t.progress_bar_metrics)}


def non_pytorch_scheduler(outdir: str) -> dict[str, Any]:
    class Incompatible:
        def __init__(self, optimizer: Any) -> None:
            self.optimizer = optimizer

        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, _: Any) -> None:
            pass

    out = {}
    for automatic in (True, False):

        class Model(BoringModel):
            def configure_optimizers(self) -> Any:
                opt = optim.SGD(self.layer.parameters(), lr=0.1)
                return [opt], [Incompatible(opt)]

        model = Model()
        model.automatic_optimization = automatic
        out[str(automatic)] = outcome(lambda model=model: trainer(outdir, max_epochs=0).fit(model))
    return out


# ---- test_optimizers.py -------------------------------------------------------------------------
def optimizer_with_scheduling(outdir: str) -> dict[str, Any]:
    t = trainer(outdir, max_epochs=1, limit_val_batches=0.1, limit_train_batches=0.2, val_check_interval=0.5)
    t.fit(BoringModel())
    return {"configs": len(t.lr_scheduler_configs), "lr": _lrs(t.optimizers[0])}


def multi_optimizer_with_scheduling(outdir: str) -> dict[str, Any]:
    class Model(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt1, opt2 = self.optimizers()
            loss = self.loss(self.step(batch))
            opt1.zero_grad()
            opt2.zero_grad()
            self.manual_backward(loss)
            opt1.step()
            opt2.step()

        def on_train_epoch_end(self) -> None:
            for scheduler in self.lr_schedulers():
                scheduler.step()

        def configure_optimizers(self) -> Any:
            o1, o2 = optim.Adam(self.parameters(), lr=5e-4), optim.Adam(self.parameters(), lr=5e-4)
            return [o1, o2], [
                optim.lr_scheduler.StepLR(o1, step_size=1),
                optim.lr_scheduler.StepLR(o2, step_size=1),
            ]

    t = trainer(outdir, max_epochs=1, limit_val_batches=0.1, limit_train_batches=0.2)
    t.fit(Model())
    return {"configs": len(t.lr_scheduler_configs), "lrs": [_lrs(o) for o in t.optimizers]}


def _config(cfg: Any) -> list[Any]:
    return [cfg.interval, cfg.frequency, cfg.reduce_on_plateau, cfg.monitor, cfg.strict, cfg.name]


def optimizer_return_forms(outdir: str) -> dict[str, Any]:
    """Each form configure_optimizers may return: optimizers and scheduler configs as parsed."""

    def forms(model: BoringModel) -> dict[str, Any]:
        opt_a = optim.Adam(model.parameters(), lr=0.002)
        opt_b = optim.SGD(model.parameters(), lr=0.002)
        sched_a = optim.lr_scheduler.StepLR(opt_a, 10)
        sched_b = optim.lr_scheduler.StepLR(opt_b, 10)
        return {
            "single": (True, opt_a),
            "tuple": (False, (opt_a, opt_b)),
            "list": (False, [opt_a, opt_b]),
            "two_lists": (True, ([opt_a], [sched_a])),
            "list_and_scheduler": (True, ([opt_a], sched_a)),
            "dict": (True, {"optimizer": opt_a, "lr_scheduler": sched_a}),
            "dict_only_optimizer": (True, {"optimizer": opt_a}),
            "list_of_dicts": (
                False,
                [
                    {"optimizer": opt_a, "lr_scheduler": sched_a},
                    {"optimizer": opt_b, "lr_scheduler": sched_b},
                ],
            ),
            "monitor_dict": (
                True,
                {
                    "optimizer": opt_a,
                    "lr_scheduler": optim.lr_scheduler.ReduceLROnPlateau(opt_a),
                    "monitor": "foo",
                },
            ),
        }

    out = {}
    for name in forms(BoringModel()):

        class Model(BoringModel):
            def training_step(self, batch: Any, batch_idx: int) -> Any:
                self.log("foo", float(batch_idx))
                if self.automatic_optimization:
                    return super().training_step(batch, batch_idx)
                return None

            def configure_optimizers(self, name: str = name) -> Any:
                return forms(self)[name][1]

        model = Model()
        model.automatic_optimization = forms(model)[name][0]
        t = trainer(outdir, fast_dev_run=True)
        t.fit(model)
        out[name] = {
            "optimizers": [type(o).__name__ for o in t.optimizers],
            "schedulers": [_config(c) for c in t.lr_scheduler_configs],
        }
    return out


def none_optimizer(outdir: str) -> dict[str, Any]:
    class Model(BoringModel):
        def configure_optimizers(self) -> None:
            return None

    model = Model()
    before = model.layer.weight.clone()
    t = trainer(outdir, max_epochs=1, limit_val_batches=0.1, limit_train_batches=0.2)
    result = outcome(lambda: t.fit(model))
    return {
        "outcome": result,
        "global_step": t.global_step,
        "weights_same": torch.equal(before, model.layer.weight),
    }


def no_optimizers_outside_fit(outdir: str) -> dict[str, Any]:
    class Model(BoringModel):
        def configure_optimizers(self) -> Any:
            o1, o2 = optim.Adam(self.parameters(), lr=0.1), optim.Adam(self.parameters(), lr=0.1)
            return [o1, o2], [
                optim.lr_scheduler.StepLR(o1, step_size=1),
                optim.lr_scheduler.StepLR(o2, step_size=1),
            ]

    out = {}
    for fn in ("validate", "test", "predict"):
        t = trainer(outdir, fast_dev_run=2)
        getattr(t, fn)(Model(), datamodule=BoringDataModule(), ckpt_path=None)
        out[fn] = [len(t.optimizers), len(t.lr_scheduler_configs)]
    return out


def configuration_errors(outdir: str) -> dict[str, Any]:
    """Malformed configure_optimizers returns: an error, a warning, or accepted."""

    def run(make: Any, **kwargs: Any) -> str:
        class Model(BoringModel):
            def configure_optimizers(self) -> Any:
                return make(self)

        return outcome(lambda: trainer(outdir, fast_dev_run=True, **kwargs).fit(Model()))

    def plateau_list(m: Any) -> Any:
        opt = optim.Adam(m.parameters())
        return [opt], [optim.lr_scheduler.ReduceLROnPlateau(opt)]

    def plateau_dict(m: Any) -> Any:
        opt = optim.Adam(m.parameters())
        return {"optimizer": opt, "lr_scheduler": {"scheduler": optim.lr_scheduler.ReduceLROnPlateau(opt)}}

    def unknown_interval(m: Any) -> Any:
        opt = optim.Adam(m.parameters())
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": optim.lr_scheduler.StepLR(opt, 1), "interval": "bad"},
        }

    def scheduler_extra_keys(m: Any) -> Any:
        opt = optim.Adam(m.parameters())
        return {"optimizer": opt, "lr_scheduler": {"scheduler": optim.lr_scheduler.StepLR(opt, 1), "foo": 1}}

    def optimizer_extra_keys(m: Any) -> Any:
        opt = optim.Adam(m.parameters())
        return {"optimizer": opt, "lr_scheduler": {"scheduler": optim.lr_scheduler.StepLR(opt, 1)}, "foo": 1}

    def no_scheduler(m: Any) -> Any:
        return {"optimizer": optim.Adam(m.parameters()), "lr_scheduler": {}}

    def foreign_optimizer(m: Any) -> Any:
        opt1, opt2 = optim.SGD(m.layer.parameters(), lr=0.1), optim.SGD(m.layer.parameters(), lr=0.1)
        return [opt1], [optim.lr_scheduler.StepLR(opt2, step_size=1)]

    def mixed_list(m: Any) -> Any:
        return [{"optimizer": optim.Adam(m.parameters())}, optim.Adam(m.parameters())]

    def one_cycle_epoch(m: Any) -> Any:
        opt = optim.Adam(m.parameters())
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=3)},
        }

    return {
        "plateau_without_monitor": run(plateau_list),
        "plateau_dict_without_monitor": run(plateau_dict),
        "unknown_return": run(lambda m: 1),
        "unknown_interval": run(unknown_interval),
        "scheduler_extra_keys": run(scheduler_extra_keys),
        "optimizer_extra_keys": run(optimizer_extra_keys),
        "no_scheduler": run(no_scheduler),
        "foreign_optimizer": run(foreign_optimizer),
        "mixed_list": run(mixed_list),
        "one_cycle_epoch_interval": run(one_cycle_epoch),
    }


def custom_reduce_on_plateau(outdir: str) -> dict[str, Any]:
    class Custom:
        def __init__(self, optimizer: Any) -> None:
            self.optimizer, self.metrics = optimizer, []

        def step(self, metric: Any = None) -> None:
            self.metrics.append(float(metric))

        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, _: Any) -> None:
            pass

    class Model(BoringModel):
        def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
            scheduler.step(metric)  # not torch's API: the module steps it

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            self.log("my_loss", float(batch_idx))
            return super().training_step(batch, batch_idx)

        def configure_optimizers(self) -> Any:
            opt = optim.SGD(self.parameters(), lr=0.1)
            self.custom = Custom(opt)
            return {
                "optimizer": opt,
                "lr_scheduler": {"reduce_on_plateau": True, "scheduler": self.custom, "monitor": "my_loss"},
            }

    model = Model()
    t = trainer(outdir, max_epochs=2, limit_train_batches=3, limit_val_batches=0)
    t.fit(model)
    return {"config": _config(t.lr_scheduler_configs[0]), "stepped_with": model.custom.metrics}


def scheduler_strict(outdir: str) -> dict[str, Any]:
    out = {}
    for complete in (True, False):
        for strict in (True, False):

            class Model(BoringModel):
                def configure_optimizers(self, strict: bool = strict) -> Any:
                    opt = optim.Adam(self.parameters())
                    self.sched = optim.lr_scheduler.ReduceLROnPlateau(opt)
                    return {
                        "optimizer": opt,
                        "lr_scheduler": {"scheduler": self.sched, "monitor": "giraffe", "strict": strict},
                    }

            model = Model()
            t = trainer(
                outdir,
                max_epochs=1 if complete else None,
                max_steps=-1 if complete else 1,
                limit_train_batches=4,
                limit_val_batches=1,
            )
            result = outcome(lambda t=t, model=model: t.fit(model))
            out[f"{complete}-{strict}"] = [result, model.sched.last_epoch]
    return out


def epoch_scheduler_frequency(outdir: str) -> dict[str, Any]:
    out = {}
    for every in (1, 2):
        model = BoringModel()
        t = trainer(
            outdir, limit_train_batches=2, limit_val_batches=2, check_val_every_n_epoch=every, max_epochs=4
        )
        t.fit(model)
        sched = t.lr_scheduler_configs[0].scheduler
        out[str(every)] = [sched.last_epoch, _lrs(t.optimizers[0])]
    return out


def scheduler_state_when_saved(outdir: str) -> dict[str, Any]:
    out = {}
    for every_n, epoch_interval in ((None, True), (2, False), (2, True)):

        class Model(BoringModel):
            def __init__(self) -> None:
                super().__init__()
                self.seen: list[Any] = []

            def configure_optimizers(self, epoch_interval: bool = epoch_interval) -> Any:
                opt = optim.SGD(self.parameters(), lr=1)
                config = {"scheduler": optim.lr_scheduler.StepLR(opt, step_size=1, gamma=10)}
                if not epoch_interval:
                    config["interval"] = "step"
                return [opt], [config]

            def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
                sched = self.lr_schedulers()
                self.seen.append([self.global_step, sched.last_epoch, sched.get_last_lr()])

        where = os.path.join(outdir, f"{every_n}{epoch_interval}")
        model = Model()
        t = L.Trainer(
            default_root_dir=where,
            logger=False,
            max_epochs=1,
            limit_train_batches=2,
            limit_val_batches=1,
            callbacks=[ModelCheckpoint(dirpath=where, every_n_train_steps=every_n)],
            **QUIET,
        )
        t.fit(model)
        out[f"{every_n}-{epoch_interval}"] = model.seen
    return out


def plateau_step_interval_when_saved(outdir: str) -> dict[str, Any]:
    out = {}
    for on_train_epoch_end in (False, True):

        class Model(BoringModel):
            def __init__(self) -> None:
                super().__init__()
                self.seen: list[Any] = []

            def training_step(self, batch: Any, batch_idx: int) -> Any:
                self.log("foo", float(batch_idx))
                return super().training_step(batch, batch_idx)

            def configure_optimizers(self) -> Any:
                opt = optim.Adam(self.parameters())
                self.plateau = optim.lr_scheduler.ReduceLROnPlateau(opt)
                self.steplr = optim.lr_scheduler.StepLR(opt, step_size=1)
                return [opt], [
                    {"scheduler": self.plateau, "interval": "step", "monitor": "foo"},
                    {"scheduler": self.steplr, "interval": "step"},
                ]

            def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
                self.seen.append([self.plateau.last_epoch, self.steplr.last_epoch])

        where = os.path.join(outdir, str(on_train_epoch_end))
        model = Model()
        t = L.Trainer(
            default_root_dir=where,
            logger=False,
            max_epochs=1,
            limit_train_batches=4,
            limit_val_batches=1,
            callbacks=[ModelCheckpoint(dirpath=where, save_on_train_epoch_end=on_train_epoch_end)],
            **QUIET,
        )
        t.fit(model)
        out[str(on_train_epoch_end)] = model.seen
    return out


def lr_scheduler_step_hook(outdir: str) -> dict[str, Any]:
    class EpochScheduler:
        def __init__(self, optimizer: Any) -> None:
            self.optimizer, self.epochs = optimizer, []

        def step(self, epoch: int) -> None:
            self.epochs.append(epoch)

        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, _: Any) -> None:
            pass

    class Model(BoringModel):
        def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
            if isinstance(scheduler, optim.lr_scheduler.StepLR):
                super().lr_scheduler_step(scheduler, metric)
            else:
                scheduler.step(epoch=self.current_epoch)

        def configure_optimizers(self) -> Any:
            opt = optim.SGD(self.layer.parameters(), lr=1e-2)
            self.steplr = optim.lr_scheduler.StepLR(opt, step_size=1)
            self.custom = EpochScheduler(opt)
            return [opt], [{"scheduler": self.steplr, "interval": "step"}, self.custom]

    model = Model()
    trainer(outdir, max_epochs=3, limit_train_batches=2, limit_val_batches=0).fit(model)
    return {"custom_epochs": model.custom.epochs, "steplr_last_epoch": model.steplr.last_epoch}


def invalid_custom_schedulers(outdir: str) -> dict[str, Any]:
    class NoStateDict:
        def __init__(self, optimizer: Any) -> None:
            self.optimizer = optimizer

        def step(self) -> None: ...

    class OtherStep:
        def __init__(self, optimizer: Any) -> None:
            self.optimizer = optimizer

        def step(self, foobar: Any) -> None: ...

        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, _: Any) -> None: ...

    def run(cls: type, override: bool) -> str:
        class Model(BoringModel):
            def configure_optimizers(self) -> Any:
                opt = optim.SGD(self.parameters(), lr=1e-2)
                return {"optimizer": opt, "lr_scheduler": cls(opt)}

        if override:
            Model.lr_scheduler_step = lambda self, scheduler, metric: None
        return outcome(lambda: trainer(outdir, fast_dev_run=True).fit(Model()))

    return {
        "missing_state_dict": run(NoStateDict, False),
        "other_step": run(OtherStep, False),
        "other_step_overridden": run(OtherStep, True),
    }


SECTIONS = [
    backward_count_simple,
    backward_count_accumulation,
    backward_count_closure,
    multiple_optimizers_automatic_raises,
    multiple_optimizers_manual,
    manual_closure,
    manual_closure_frequencies,
    manual_lr_schedulers,
    manual_plateau,
    manual_scheduler_not_stepped,
    manual_logging_two_optimizers,
    non_pytorch_scheduler,
    optimizer_with_scheduling,
    multi_optimizer_with_scheduling,
    optimizer_return_forms,
    none_optimizer,
    no_optimizers_outside_fit,
    configuration_errors,
    custom_reduce_on_plateau,
    scheduler_strict,
    epoch_scheduler_frequency,
    scheduler_state_when_saved,
    plateau_step_interval_when_saved,
    lr_scheduler_step_hook,
    invalid_custom_schedulers,
]

if __name__ == "__main__":
    run_sections(sys.argv[1], SECTIONS, L.seed_everything)
