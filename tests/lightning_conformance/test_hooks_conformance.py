"""Lightning 2.6's ``tests_pytorch/models/test_hooks.py`` and ``core/test_lightning_module.py`` promises (hooks_program.py, one section each)
against what Lightning 2.6.6 itself did (tests/fixtures/lightning/hooks_program.json)."""

from __future__ import annotations

from typing import Any

import pytest
from lightning_compare import assert_section_matches

PROGRAM = "hooks_program"
SECTIONS = [
    "on_before_zero_grad_count",
    "epoch_end_progress_bar_metrics",
    "fit_hooks_automatic",
    "fit_hooks_manual",
    "fit_no_val_resume_max_epochs",
    "fit_no_val_resume_max_steps",
    "eval_hooks",
    "predict_hooks",
    "different_argument_names",
    "datamodule_hooks",
    "load_from_checkpoint_hooks",
    "train_eval_mode_restored",
    "module_properties",
    "toggle_one_optimizer",
    "toggle_optimizers",
    "configure_gradient_clipping_hook",
    "configure_gradient_clipping_conflicts",
    "device_placement",
]


@pytest.mark.parametrize("section", SECTIONS)
def test_section(observed: dict[str, Any], section: str) -> None:
    assert_section_matches(PROGRAM, observed, section)
