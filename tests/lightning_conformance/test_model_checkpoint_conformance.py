"""Lightning 2.6.6's ``checkpointing/test_model_checkpoint.py`` promises
(tests/lightning_conformance/model_checkpoint_program.py: names, triggers, selection), one test per section, each against Lightning's own
recording of the same scenario."""

from __future__ import annotations

from typing import Any

import pytest
from lightning_compare import assert_section_matches

PROGRAM = "model_checkpoint_program"


@pytest.mark.parametrize(
    "section",
    [
        "state_key",
        "score_and_ckpt",
        "score_and_ckpt_val_check_interval",
        "with_non_string_input",
        "to_yaml",
        "model_checkpoint_path",
        "pickling",
        "format_checkpoint_name",
        "file_extension",
        "save_last",
        "argument_checks",
        "none_monitor_not_alternating",
        "save_last_none_monitor",
        "every_n_epochs",
        "every_n_train_steps",
        "train_time_interval",
        "topk_zero",
        "topk_all",
        "ckpt_metric_names",
        "default_checkpoint_behavior",
        "configure_model_checkpoint",
        "val_check_interval_checkpoint_files",
        "check_val_every_n_epochs_top_k",
    ],
)
def test_section(observed: dict[str, Any], section: str) -> None:
    assert_section_matches(PROGRAM, observed, section)
