"""Lightning names nanolight does not have fail on import with one line saying what to use
instead (``errors.LIGHTNING_ONLY``), never a bare ImportError; other names keep Python's usual
errors, so ``hasattr`` and submodule imports are unaffected."""

from __future__ import annotations

import importlib

import pytest

from nanolight.errors import LIGHTNING_ONLY, NotSupported


@pytest.mark.parametrize(
    ("package", "name", "says"),
    [
        ("callbacks", "StochasticWeightAveraging", "Callback"),
        ("callbacks", "TQDMProgressBar", "RichProgressBar"),
        ("callbacks", "GradientAccumulationScheduler", "accumulate_grad_batches"),
        ("loggers", "TensorBoardLogger", "CSVLogger"),
        ("utilities", "CombinedLoader", "DataLoader"),
        ("profilers", "SimpleProfiler", "torch.profiler"),
    ],
)
def test_a_lightning_name_says_what_to_use(package: str, name: str, says: str) -> None:
    with pytest.raises(NotSupported) as info:
        exec(f"from nanolight.{package} import {name}", {})
    message = str(info.value)
    assert "\n" not in message and f"nanolight.{package}.{name}" in message and says in message
    assert isinstance(info.value, ImportError)


def test_every_listed_name_is_missing_and_every_package_answers() -> None:
    for package, names in LIGHTNING_ONLY.items():
        module = importlib.import_module(f"nanolight.{package}")
        for name in names:
            assert name not in vars(module), f"nanolight.{package}.{name} exists: drop it from LIGHTNING_ONLY"
            with pytest.raises(NotSupported):
                getattr(module, name)


def test_other_names_keep_pythons_errors() -> None:
    import nanolight.callbacks as callbacks

    assert not hasattr(callbacks, "NoSuchCallback")
    with pytest.raises(ImportError, match="cannot import name"):
        exec("from nanolight.callbacks import NoSuchCallback", {})
    from nanolight.utilities import imports  # a submodule still imports through the package

    assert imports.__name__ == "nanolight.utilities.imports"
