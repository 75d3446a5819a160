"""Lightning 2.6.6's ``models/test_hparams.py`` promises (tests/lightning_conformance/hparams_checkpoint_program.py: through a trainer, a checkpoint, a logger), one
test per section, each against Lightning's own recording of the same scenario; the hparams.yaml files
the sections' loggers wrote are compared too."""

from __future__ import annotations

from typing import Any

import pytest
from lightning_compare import assert_files_match, assert_section_matches

PROGRAM = "hparams_checkpoint_program"


def test_logged_hparams_files(observed: dict[str, Any]) -> None:
    """Every hparams.yaml (and metrics.csv) the sections' loggers wrote."""
    assert_files_match(PROGRAM, observed)


@pytest.mark.parametrize(
    "section",
    [
        "namespace_hparams",
        "dict_hparams",
        "explicit_implicit_missing_args",
        "collect_init_arguments",
        "model_ignores_non_exist_kwargument",
        "ignore_args_list_hparams",
        "hparams_name_from_container",
        "args",
        "init_arg_with_runtime_change",
        "adding_datamodule_hparams",
        "colliding_hparams",
        "model_nohparams_train_test",
        "hparams_pickle_warning",
    ],
)
def test_section(observed: dict[str, Any], section: str) -> None:
    assert_section_matches(PROGRAM, observed, section)
