"""Lightning 2.6.6's ``callbacks/test_early_stopping.py`` promises
(tests/lightning_conformance/early_stopping_program.py), one test per section, each against Lightning's own
recording of the same scenario."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from lightning_compare import assert_section_matches, run_ported

PROGRAM = "early_stopping_program"


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_ported(PROGRAM, Path(tmp_path_factory.mktemp(PROGRAM)))


@pytest.mark.parametrize(
    "section",
    [
        "state_key",
        "resume_from_checkpoint",
        "no_extraneous_invocations",
        "patience",
        "patience_train",
        "pickling",
        "no_val_step",
        "thresholds",
        "non_finite_monitor",
        "min_epochs_min_steps_global_step",
        "mode_options",
        "multiple_early_stopping_callbacks",
        "check_on_train_epoch_end_smart_handling",
        "squeezes",
        "reasons",
    ],
)
def test_section(observed: dict[str, Any], section: str) -> None:
    assert_section_matches(PROGRAM, observed, section)
