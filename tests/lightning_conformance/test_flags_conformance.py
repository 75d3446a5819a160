"""Lightning 2.6's ``tests_pytorch/trainer/flags/*`` promises (flags_program.py, one section each)
against what Lightning 2.6.6 itself did (tests/fixtures/lightning/flags_program.json)."""

from __future__ import annotations

from typing import Any

import pytest
from lightning_compare import assert_section_matches, fixture

PROGRAM = "flags_program"
SECTIONS = [
    "check_val_every_n_epoch",
    "check_val_every_n_epoch_with_max_steps",
    "min_max_steps_epochs",
    "max_epochs_not_set",
    "barebones_selection",
    "barebones_raises",
    "barebones_log",
    "fast_dev_run",
    "inference_mode",
    "num_dataloader_batches",
    "eval_limit_batches",
    "overfit_basic",
    "overfit_same_batches",
    "overfit_eval_limits",
    "val_check_interval",
    "val_check_interval_exceeds_epoch",
    "val_check_interval_errors",
]
ACCUMULATE = 2  # val_check_mid_window's accumulate_grad_batches


@pytest.mark.parametrize("section", SECTIONS)
def test_section(observed: dict[str, Any], section: str) -> None:
    assert_section_matches(PROGRAM, observed, section)


def test_validation_due_inside_a_window_runs_after_its_step(observed: dict[str, Any]) -> None:
    """The README's difference: a check batch inside an accumulation window validates once the
    window's optimizer step is done (the window's micro-batches run as one schedule), where
    Lightning validates mid-window. Everything else -- which windows validate, how many times, the
    epochs and steps -- is Lightning's."""
    want, got = fixture(PROGRAM)["val_check_mid_window"], observed["val_check_mid_window"]
    for key, run in want.items():
        moved = []
        for batches, step in run["val_at"]:
            inside = batches % ACCUMULATE
            moved.append([batches + ACCUMULATE - inside, step + 1] if inside else [batches, step])
        assert inside is not None and any(b % ACCUMULATE for b, _ in run["val_at"])  # the case is exercised
        assert got[key] == {**run, "val_at": moved}, key
