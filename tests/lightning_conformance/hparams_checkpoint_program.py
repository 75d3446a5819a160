"""The promises of Lightning 2.6.6's ``tests_pytorch/models/test_hparams.py`` that go through a trainer, a
checkpoint or a logger (``hparams_program.py`` has what ``save_hyperparameters`` collects), as scenarios
of ours: what
``save_hyperparameters`` collects (arguments, explicit names, ``ignore``, containers, subclasses,
dataclasses, composition), what a checkpoint carries back through ``load_from_checkpoint`` (with
overrides), and what the loggers' ``hparams.yaml`` holds. One section per promise (see COVERAGE.md);
run: ``python hparams_checkpoint_program.py OUTDIR``.
"""

from __future__ import annotations

import functools
import os
import sys
from argparse import Namespace
from typing import Any

import lightning as L
import torch
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel, RandomDataset
from lightning.pytorch.loggers import CSVLogger
from observe import raises, run_sections, to_jsonable
from torch.utils.data import DataLoader

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


def decorate(func: Any) -> Any:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return func(*args, **kwargs)

    return wrapper


class SaveHparamsModel(BoringModel):
    def __init__(self, hparams: Any) -> None:
        super().__init__()
        self.save_hyperparameters(hparams)


class SaveHparamsDecoratedModel(BoringModel):
    @decorate
    @decorate
    def __init__(self, hparams: Any, *my_args: Any, **my_kwargs: Any) -> None:
        super().__init__()
        self.save_hyperparameters(hparams)


class SaveHparamsDataModule(BoringDataModule):
    def __init__(self, hparams: Any) -> None:
        super().__init__()
        self.save_hyperparameters(hparams)


class SaveHparamsDecoratedDataModule(BoringDataModule):
    @decorate
    @decorate
    def __init__(self, hparams: Any, *my_args: Any, **my_kwargs: Any) -> None:
        super().__init__()
        self.save_hyperparameters(hparams)


CLASSES = [SaveHparamsModel, SaveHparamsDecoratedModel, SaveHparamsDataModule, SaveHparamsDecoratedDataModule]


def _standard(outdir: str, make: Any) -> dict[str, Any]:
    out = {}
    for cls in CLASSES:
        where = os.path.join(outdir, cls.__name__)
        is_dm = issubclass(cls, L.LightningDataModule)
        obj = cls(hparams=make())
        model = BoringModel() if is_dm else obj
        path = _fit_and_checkpoint(where, model, datamodule=obj if is_dm else None)
        loaded = cls.load_from_checkpoint(path)
        out[cls.__name__] = {
            "type": type(obj.hparams).__name__,
            "loaded": _hp(loaded),
            "loaded_type": type(loaded.hparams).__name__,
        }
    return out


def namespace_hparams(outdir: str) -> dict[str, Any]:
    return _standard(outdir, lambda: Namespace(test_arg=14))


def dict_hparams(outdir: str) -> dict[str, Any]:
    return _standard(outdir, lambda: {"test_arg": 14})


class ExplicitArgs(BoringModel):
    def __init__(self, test_arg: int, test_arg2: int) -> None:
        super().__init__()
        self.save_hyperparameters("test_arg", "test_arg2")


class ImplicitArgs(BoringModel):
    def __init__(self, test_arg: int, test_arg2: int) -> None:
        super().__init__()
        self.save_hyperparameters()


class ExplicitMissing(BoringModel):
    def __init__(self, test_arg: int, test_arg2: int) -> None:
        super().__init__()
        self.save_hyperparameters("test_arg")


def explicit_implicit_missing_args(outdir: str) -> dict[str, Any]:
    out = {}
    for cls in (ExplicitArgs, ImplicitArgs, ExplicitMissing):
        model = cls(test_arg=14, test_arg2=90)
        path = _fit_and_checkpoint(os.path.join(outdir, cls.__name__), model)
        out[cls.__name__] = {
            "hparams": _hp(model),
            "reloaded": _hp(cls.load_from_checkpoint(path, test_arg2=120)),
        }
    return out


class CustomBoringModel(BoringModel):
    def __init__(self, batch_size: int = 64) -> None:
        super().__init__()
        self.save_hyperparameters()


class SubClassBoringModel(CustomBoringModel):
    any_other_loss = torch.nn.CrossEntropyLoss()

    def __init__(self, *args: Any, subclass_arg: int = 1200, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.save_hyperparameters()


class NonSavingSubClassBoringModel(CustomBoringModel):
    def __init__(self, *args: Any, subclass_arg: int = 1200, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)


class SubSubClassBoringModel(SubClassBoringModel):
    pass


class UnconventionalArgsBoringModel(CustomBoringModel):
    def __init__(obj: Any, batch_size: int = 64) -> None:  # noqa: N805  (self named otherwise)
        super().__init__(batch_size=batch_size)
        obj.save_hyperparameters()


class MixinForBoringModel:
    any_other_loss = torch.nn.CrossEntropyLoss()

    def __init__(self, *args: Any, subclass_arg: int = 1200, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)


class BoringModelWithMixin(MixinForBoringModel, CustomBoringModel):
    pass


def collect_init_arguments(outdir: str) -> dict[str, Any]:
    out = {}
    for cls in (
        CustomBoringModel,
        SubClassBoringModel,
        NonSavingSubClassBoringModel,
        SubSubClassBoringModel,
        UnconventionalArgsBoringModel,
        BoringModelWithMixin,
    ):
        default = _hp(cls())
        model = cls(batch_size=179)
        path = _fit_and_checkpoint(os.path.join(outdir, cls.__name__), model)
        out[cls.__name__] = {
            "default": default,
            "given": _hp(model),
            "reloaded": _hp(cls.load_from_checkpoint(path)),
            "overridden": _hp(cls.load_from_checkpoint(path, batch_size=99)),
        }
    return out


class UnpickleableArgs(BoringModel):
    def __init__(self, foo: str = "bar", pickle_me: Any = (lambda x: x + 1), ignore: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["pickle_me"] if ignore else None)


def hparams_pickle_warning(outdir: str) -> dict[str, Any]:
    out = {}
    for ignore in (False, True):
        model = UnpickleableArgs(ignore=ignore)
        trainer = L.Trainer(default_root_dir=outdir, max_steps=1, logger=False, **QUIET)
        trainer.fit(model)
        out[str(ignore)] = sorted(model.hparams)
    return out


class NoArgsSubClass(CustomBoringModel):
    def __init__(self) -> None:
        super().__init__()


def model_nohparams_train_test(outdir: str) -> dict[str, Any]:
    out = {}
    for cls in (BoringModel, NoArgsSubClass):
        model = cls()
        trainer = L.Trainer(max_epochs=1, default_root_dir=outdir, logger=False, **QUIET)
        trainer.fit(model, DataLoader(RandomDataset(32, 64), batch_size=32))
        result = trainer.test(dataloaders=DataLoader(RandomDataset(32, 64), batch_size=32), verbose=False)
        out[cls.__name__] = {"hparams": _hp(model), "tests": len(result)}
    return out


class DefaultBatch(BoringModel):
    def __init__(self, batch_size: int = 15) -> None:
        super().__init__()
        self.save_hyperparameters()


def model_ignores_non_exist_kwargument(outdir: str) -> dict[str, Any]:
    path = _fit_and_checkpoint(outdir, DefaultBatch())
    return {"hparams": _hp(DefaultBatch.load_from_checkpoint(path, non_exist_kwarg=99))}


class RuntimeChange(BoringModel):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.save_hyperparameters()


def init_arg_with_runtime_change(outdir: str) -> dict[str, Any]:
    model = RuntimeChange(running_arg=123)
    model.hparams.running_arg = -1
    trainer = L.Trainer(
        default_root_dir=outdir, logger=CSVLogger(outdir), enable_checkpointing=False, **SHORT, **QUIET
    )
    trainer.fit(model)
    return {"hparams": _hp(model)}  # hparams.yaml (the initial value) is part of the record


class IgnoreArgs(BoringModel):
    def __init__(self, arg1: int, arg2: int, arg3: int, ignore: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=ignore)


def ignore_args_list_hparams(outdir: str) -> dict[str, Any]:
    out = {}
    for ignore in ("arg2", ("arg2", "arg3")):
        model = IgnoreArgs(arg1=14, arg2=90, arg3=50, ignore=ignore)
        path = _fit_and_checkpoint(os.path.join(outdir, str(len(ignore))), model)
        out[str(ignore)] = {
            "hparams": _hp(model),
            "reloaded": _hp(IgnoreArgs.load_from_checkpoint(path, arg2=123, arg3=100)),
        }
    return out


class KwargsContainer(BoringModel):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.save_hyperparameters(kwargs)


class NamespaceContainer(BoringModel):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.save_hyperparameters(config)


def hparams_name_from_container(outdir: str) -> dict[str, Any]:
    """The container's argument name is what a reload passes it back as (``config=...``); kwargs
    given as a container come back as keywords."""
    out = {}
    for name, model in (
        ("kwargs", KwargsContainer(a=1, b=2)),
        ("namespace", NamespaceContainer(Namespace(a=1, b=2))),
    ):
        path = _fit_and_checkpoint(os.path.join(outdir, name), model)
        out[name] = _hp(type(model).load_from_checkpoint(path))
    return out


class DataWithHparams(L.LightningDataModule):
    def __init__(self, hparams: Any) -> None:
        super().__init__()
        self.save_hyperparameters(hparams)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 64), batch_size=32)


class DataWithoutHparams(L.LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 64), batch_size=32)


class NoHparams(BoringModel):
    pass


def adding_datamodule_hparams(outdir: str) -> dict[str, Any]:
    """What the logger's hparams.yaml holds for each pair (it is part of the record)."""
    out = {}
    for m_name, make_model in (
        ("model", lambda: SaveHparamsModel({"arg1": 5, "arg2": "abc"})),
        ("none", NoHparams),
    ):
        for d_name, make_data in (
            ("data", lambda: DataWithHparams({"data_dir": "foo"})),
            ("none", DataWithoutHparams),
        ):
            model, data = make_model(), make_data()
            where = os.path.join(outdir, f"{m_name}-{d_name}")
            trainer = L.Trainer(
                default_root_dir=where, max_epochs=1, limit_train_batches=1, logger=CSVLogger(where), **QUIET
            )
            trainer.fit(model, datamodule=data)
            out[f"{m_name}-{d_name}"] = {"model": _hp(model), "data": _hp(data)}
    return out


def colliding_hparams(outdir: str) -> dict[str, Any]:
    model = SaveHparamsModel({"data_dir": "abc", "arg2": "abc"})
    data = DataWithHparams({"data_dir": "foo"})
    trainer = L.Trainer(default_root_dir=outdir, max_epochs=1, logger=CSVLogger(outdir), **QUIET)
    return {"raised": raises(trainer.fit, model, datamodule=data)}


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


SECTIONS = [
    namespace_hparams,
    dict_hparams,
    explicit_implicit_missing_args,
    collect_init_arguments,
    model_ignores_non_exist_kwargument,
    ignore_args_list_hparams,
    hparams_name_from_container,
    args,
    init_arg_with_runtime_change,
    adding_datamodule_hparams,
    colliding_hparams,
    model_nohparams_train_test,
    hparams_pickle_warning,
]

if __name__ == "__main__":
    run_sections(sys.argv[1], SECTIONS, L.seed_everything)
