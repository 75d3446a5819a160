"""Lightning 2.6's ``tests_pytorch/trainer/optimization/*`` promises (optimization_program.py, one section each)
against what Lightning 2.6.6 itself did (tests/fixtures/lightning/optimization_program.json)."""

from __future__ import annotations

from typing import Any

import pytest
from lightning_compare import assert_section_matches

PROGRAM = "optimization_program"
SECTIONS = [
    "backward_count_simple",
    "backward_count_accumulation",
    "multiple_optimizers_automatic_raises",
    "multiple_optimizers_manual",
    "manual_closure",
    "manual_closure_frequencies",
    "manual_lr_schedulers",
    "manual_plateau",
    "manual_scheduler_not_stepped",
    "manual_logging_two_optimizers",
    "non_pytorch_scheduler",
    "optimizer_with_scheduling",
    "multi_optimizer_with_scheduling",
    "optimizer_return_forms",
    "none_optimizer",
    "no_optimizers_outside_fit",
    "configuration_errors",
    "custom_reduce_on_plateau",
    "scheduler_strict",
    "epoch_scheduler_frequency",
    "scheduler_state_when_saved",
    "plateau_step_interval_when_saved",
    "lr_scheduler_step_hook",
    "invalid_custom_schedulers",
]


@pytest.mark.parametrize("section", SECTIONS)
def test_section(observed: dict[str, Any], section: str) -> None:
    assert_section_matches(PROGRAM, observed, section)


def test_closure_optimizers_are_refused(observed: dict[str, Any]) -> None:
    """The README's difference: an optimizer that re-evaluates the loss through a closure (LBFGS)
    is refused with one line, where Lightning runs its closure (one backward per evaluation)."""
    error = observed["backward_count_closure"].get("error", "")
    assert error.startswith("UsageError: LBFGS re-evaluates the loss through a closure"), error
