"""Lightning 2.6.6's ``callbacks/test_early_stopping.py`` promises
(tests/lightning_conformance/early_stopping_program.py), one test per section, each against Lightning's own
recording of the same scenario."""

from __future__ import annotations

from typing import Any

import pytest
from lightning_compare import assert_section_matches

PROGRAM = "early_stopping_program"


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
