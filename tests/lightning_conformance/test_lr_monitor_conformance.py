"""Lightning 2.6.6's ``callbacks/test_lr_monitor.py`` promises (tests/lightning_conformance/lr_monitor_program.py),
one test per section, each against Lightning's own recording of the same scenario; the rows every
section logged are compared too."""

from __future__ import annotations

from typing import Any

import pytest
from lightning_compare import assert_files_match, assert_section_matches

PROGRAM = "lr_monitor_program"


def test_logged_rows(observed: dict[str, Any]) -> None:
    """Every lr / momentum / weight-decay row each section's monitor logged, at its step."""
    assert_files_match(PROGRAM, observed)


@pytest.mark.parametrize(
    "section",
    [
        "single_lr",
        "single_lr_with_momentum",
        "momentum_no_momentum_optimizer",
        "no_lr_scheduler_single_lr",
        "no_lr_scheduler_single_lr_with_momentum",
        "momentum_no_momentum_optimizer_no_lr_scheduler",
        "no_logger",
        "multi_lrs",
        "param_groups",
        "custom_name",
        "custom_pg_name",
        "duplicate_custom_pg_names",
        "multiple_param_groups_no_lr_scheduler",
        "update_callback_metrics",
        "float64_lr",
    ],
)
def test_section(observed: dict[str, Any], section: str) -> None:
    assert_section_matches(PROGRAM, observed, section)
