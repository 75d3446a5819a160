"""Lightning 2.6.6's ``callbacks/test_timer.py`` promises (tests/lightning_conformance/timer_program.py, on a
fake clock), one test per section, each against Lightning's own recording of the same scenario."""

from __future__ import annotations

from typing import Any

import pytest
from lightning_compare import assert_section_matches

PROGRAM = "timer_program"


@pytest.mark.parametrize(
    "section",
    [
        "trainer_flag",
        "parse_duration",
        "parse_duration_misconfiguration",
        "interval_choice",
        "time_remaining",
        "stops_training",
        "zero_duration_stop",
        "duration_min_steps_override",
        "resume_training",
        "track_stages",
    ],
)
def test_section(observed: dict[str, Any], section: str) -> None:
    assert_section_matches(PROGRAM, observed, section)
