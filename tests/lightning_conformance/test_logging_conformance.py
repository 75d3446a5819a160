"""Lightning 2.6's ``tests_pytorch/trainer/logging_/*`` promises (logging_program.py, one section each)
against what Lightning 2.6.6 itself did (tests/fixtures/lightning/logging_program.json)."""

from __future__ import annotations

from typing import Any

import pytest
from lightning_compare import assert_section_matches

PROGRAM = "logging_program"
SECTIONS = [
    "training_step_log",
    "training_epoch_end_log",
    "reduce_fx",
    "dict_batches",
    "log_in_train_callback",
    "sync_dist_one_process",
    "progress_bar_at_train_end",
    "callback_self_log",
    "metric_reduced_for_callbacks",
    "log_invalid_values",
    "log_misuse_raises",
    "sanity_metrics_reset",
    "sum_on_batch_hooks",
    "epoch_and_step_rows",
    "log_on_train_start",
    "validation_step_log",
    "validation_epoch_end_log",
    "eval_epoch_logging",
    "eval_float_and_auto_reduce",
    "test_epoch_only_logging",
    "multi_dataloader_suffix",
    "log_in_eval_callbacks",
    "multiple_dataloaders_reset",
    "no_dataloader_idx",
    "multi_dataloader_epoch_end",
    "eval_step_rows",
    "where_log_is_allowed",
    "auto_add_dataloader_idx",
    "metrics_reset_per_stage",
    "logged_epoch_value",
    "batch_size_extraction",
    "logger_after_each_call",
]


@pytest.mark.parametrize("section", SECTIONS)
def test_section(observed: dict[str, Any], section: str) -> None:
    assert_section_matches(PROGRAM, observed, section)
