"""Lightning 2.6.6's ``models/test_hparams.py`` promises (tests/lightning_conformance/hparams_program.py), one
test per section, each against Lightning's own recording of the same scenario (what ``save_hyperparameters``
collects)."""

from __future__ import annotations

from typing import Any

import pytest
from lightning_compare import assert_section_matches

PROGRAM = "hparams_program"


@pytest.mark.parametrize(
    "section",
    [
        "class_nesting",
        "collect_init_arguments_in_other_methods",
        "save_hyperparameters_under_composition",
        "collect_init_arguments_with_local_vars",
        "single_config_models_fail",
        "hparams_pickle",
        "hparams_ignore_in_subclass_overrides_base",
        "save_no_parameters",
        "empty_hparams_container",
        "dataclass_lightning_module",
        "nn_modules_warning_when_saved_as_hparams",
    ],
)
def test_section(observed: dict[str, Any], section: str) -> None:
    assert_section_matches(PROGRAM, observed, section)
