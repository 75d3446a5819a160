"""Lightning 2.6.6's ``checkpointing/test_model_checkpoint.py`` promises
(tests/lightning_conformance/model_checkpoint_program.py), one test per section, each against Lightning's own
recording of the same scenario."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from lightning_compare import assert_section_matches, run_ported

PROGRAM = "model_checkpoint_program"


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_ported(PROGRAM, Path(tmp_path_factory.mktemp(PROGRAM)))


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
        "on_exception",
        "already_saved_on_exception",
        "train_time_interval",
        "topk_zero",
        "topk_all",
        "ckpt_metric_names",
        "default_checkpoint_behavior",
        "save_last_checkpoint_contents",
        "nan_as_first",
        "configure_model_checkpoint",
        "val_check_interval_checkpoint_files",
        "current_score",
        "current_score_when_nan",
        "version_after_rerun",
        "version_after_rerun_same_trainer",
        "version_counter_disabled",
        "check_val_every_n_epochs_top_k",
        "saveload_ckpt",
        "resume_and_old_checkpoint_files_remain",
        "expand_home",
        "save_last_without_validation",
        "save_last_only_when_checkpoint_saved",
        "checkpoint_repeated_strategy",
        "resume_training_preserves_old_ckpt_last",
        "save_last_every_n_epochs_interaction",
        "load_with_inf_data_loader",
    ],
)
def test_section(observed: dict[str, Any], section: str) -> None:
    assert_section_matches(PROGRAM, observed, section)
