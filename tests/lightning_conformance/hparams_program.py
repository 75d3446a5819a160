"""The promises of Lightning 2.6.6's ``tests_pytorch/models/test_hparams.py`` about what
``save_hyperparameters`` collects (containers, subclasses, composition, ``ignore``, local variables,
dataclasses, warnings), as scenarios of ours; ``hparams_checkpoint_program.py`` has the trainer,
checkpoint and logger round trips. One section per promise (see COVERAGE.md); run:
``python hparams_program.py OUTDIR``.
"""

from __future__ import annotations

import os
import pickle
import sys
import warnings
from argparse import Namespace
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.utilities import AttributeDict
from observe import raises, run_sections, to_jsonable

QUIET = {"enable_progress_bar": False, "enable_model_summary": False}
SHORT = {"max_epochs": 1, "limit_train_batches": 2, "limit_val_batches": 2}


def _fit_and_checkpoint(outdir: str, model: L.LightningModule, datamodule: Any = None, **kwargs: Any) -> str:
    trainer = L.Trainer(default_root_dir=outdir, logger=False, **{**SHORT, **kwargs}, **QUIET)
    trainer.fit(model, datamodule=datamodule)
    path = os.path.join(outdir, "model.ckpt")
    trainer.save_checkpoint(path)
    return path


def _hp(obj: Any) -> Any:
    return to_jsonable(dict(obj.hparams))


def class_nesting(outdir: str) -> dict[str, Any]:
    class MyModule(L.LightningModule):
        def forward(self) -> None: ...

    def outside() -> Any:
        return MyModule().hparams

    class A:
        def test(self) -> Any:
            return MyModule().hparams

    return {"hparams": [dict(outside()), dict(A().test())]}


class CustomBoringModel(BoringModel):
    def __init__(self, batch_size: int = 64) -> None:
        super().__init__()
        self.save_hyperparameters()


def collect_init_arguments_in_other_methods(outdir: str) -> dict[str, Any]:
    class Creator:
        def init(self, model: Any = None, **kwargs: Any) -> Any:
            return model or CustomBoringModel(**kwargs)

    return {"hparams": _hp(Creator().init(batch_size=123))}


def _composition(base: type) -> dict[str, Any]:
    class Child(base):  # type: ignore[misc, valid-type]
        def __init__(self, same_arg: str) -> None:
            super().__init__()
            self.save_hyperparameters()

    class NotLightning:
        def __init__(self, same_arg: str = "parent_default", other_arg: str = "other") -> None:
            self.child = Child(same_arg="cocofruit")

    class Ignoring(base):  # type: ignore[misc, valid-type]
        def __init__(self, learning_rate: float = 1e-3, optimizer: str = "adam") -> None:
            super().__init__()
            self.save_hyperparameters(ignore=["learning_rate"])

    class ChildModule(base):  # type: ignore[misc, valid-type]
        def __init__(self, dropout: float, activation: str, init_method: str) -> None:
            super().__init__()
            self.save_hyperparameters(ignore=["dropout", "activation"])

    class ParentModule(base):  # type: ignore[misc, valid-type]
        def __init__(self, batch_size: int, optimizer: str) -> None:
            super().__init__()
            self.child = ChildModule(dropout=0.1, activation="relu", init_method="xavier")

    class Wrapper:
        def __init__(self, run_id: str = "abc123", seed: int = 42) -> None:
            self.parent_module = ParentModule(batch_size=64, optimizer="adam")

    return {
        "composition": _hp(NotLightning().child),
        "ignore": _hp(Ignoring(learning_rate=0.01, optimizer="sgd")),
        "ignore_composition": _hp(Wrapper().parent_module.child),
    }


def save_hyperparameters_under_composition(outdir: str) -> dict[str, Any]:
    return {"module": _composition(L.LightningModule), "datamodule": _composition(L.LightningDataModule)}


class LocalVariables(BoringModel):
    def __init__(self, arg1: Any, arg2: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.argument1 = arg1
        arg1 = "overwritten"
        local_var = 1234  # noqa: F841
        self.save_hyperparameters()


def collect_init_arguments_with_local_vars(outdir: str) -> dict[str, Any]:
    return {"hparams": _hp(LocalVariables(arg1=1, arg2=2))}


class AnotherArgModel(BoringModel):
    def __init__(self, arg1: Any) -> None:
        super().__init__()
        self.save_hyperparameters(arg1)


class OtherArgsModel(BoringModel):
    def __init__(self, arg1: Any, arg2: Any) -> None:
        super().__init__()
        self.save_hyperparameters(arg1, arg2)


def single_config_models_fail(outdir: str) -> dict[str, Any]:
    return {"raised": [raises(AnotherArgModel, arg1=42), raises(OtherArgsModel, arg1=3.14, arg2="abc")]}


def hparams_pickle(outdir: str) -> dict[str, Any]:
    ad = AttributeDict({"key1": 1, "key2": "abc"})
    back = pickle.loads(pickle.dumps(ad))
    return {"equal": ad == back, "attribute": back.key2}


def hparams_ignore_in_subclass_overrides_base(outdir: str) -> dict[str, Any]:
    class Base(BoringModel):
        def __init__(self, arg1: int, arg2: int, arg3: int) -> None:
            super().__init__()
            self.save_hyperparameters(ignore="arg1")

    out = {}
    for ignore in ("arg2", ("arg2", "arg3")):

        class Local(Base):
            def __init__(self, arg1: int, arg2: int, arg3: int, ignore: Any = ignore) -> None:
                super().__init__(arg1=arg1, arg2=arg2, arg3=arg3)
                self.save_hyperparameters(
                    ignore=[*([ignore] if isinstance(ignore, str) else ignore), "ignore"]
                )

        out[str(ignore)] = _hp(Local(arg1=14, arg2=90, arg3=50))
    return out


def save_no_parameters(outdir: str) -> dict[str, Any]:
    class IgnoreAll(BoringModel):
        def __init__(self, arg1: int, arg2: int, arg3: int) -> None:
            super().__init__()
            self.save_hyperparameters(ignore=("arg1", "arg2", "arg3"))

    class NoParameters(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.save_hyperparameters()

    return {"hparams": [_hp(IgnoreAll(14, 90, 50)), _hp(NoParameters())]}


class KwargsContainer(BoringModel):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.save_hyperparameters(kwargs)


class NamespaceContainer(BoringModel):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.save_hyperparameters(config)


def empty_hparams_container(outdir: str) -> dict[str, Any]:
    return {"empty": [bool(KwargsContainer().hparams), bool(NamespaceContainer(Namespace()).hparams)]}


@dataclass(eq=False)
class DataClassModel(BoringModel):
    mandatory: int
    optional: str = "optional"
    ignore_me: bool = False

    def __post_init__(self) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=("ignore_me",))


@dataclass(eq=False)
class DataClassInitFalse(BoringModel):
    mandatory: int
    optional: str = "optional"
    non_init_field: int = field(default=999, init=False)

    def __post_init__(self) -> None:
        super().__init__()
        self.save_hyperparameters()


def dataclass_lightning_module(outdir: str) -> dict[str, Any]:
    init_false = DataClassInitFalse(33, optional="cocofruit")
    return {
        "ignore": _hp(DataClassModel(33, optional="cocofruit")),
        "init_false": _hp(init_false),
        "non_init_field": init_false.non_init_field,
    }


class SuperClassPositionalArgs(BoringModel):
    def __init__(self, hparams: Any) -> None:
        super().__init__()
        self._hparams = hparams  # set by hand, as if the base class had saved them


class SubClassVarArgs(SuperClassPositionalArgs):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)


def args(outdir: str) -> dict[str, Any]:
    """Hparams the init cannot take back: reloading fails with a TypeError."""
    path = _fit_and_checkpoint(outdir, SubClassVarArgs({"test": 1}))
    try:
        SubClassVarArgs.load_from_checkpoint(path)
    except TypeError as exc:
        return {"type_error": "test" in str(exc)}
    return {"type_error": False}


class ModuleArgs(BoringModel):
    def __init__(self, loss: torch.nn.Module, width: int = 3, ignore: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=ignore)


def nn_modules_warning_when_saved_as_hparams(outdir: str) -> dict[str, Any]:
    out = {}
    for ignore in (None, ["loss"]):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = ModuleArgs(torch.nn.MSELoss(), ignore=ignore)
        out[str(ignore)] = {
            "warned": sum("'loss'" in str(w.message) and "nn.Module" in str(w.message) for w in caught),
            "hparams": sorted(model.hparams),
        }
    return out


SECTIONS = [
    class_nesting,
    collect_init_arguments_in_other_methods,
    save_hyperparameters_under_composition,
    collect_init_arguments_with_local_vars,
    single_config_models_fail,
    hparams_pickle,
    hparams_ignore_in_subclass_overrides_base,
    save_no_parameters,
    empty_hparams_container,
    dataclass_lightning_module,
    nn_modules_warning_when_saved_as_hparams,
]

if __name__ == "__main__":
    run_sections(sys.argv[1], SECTIONS, L.seed_everything)
