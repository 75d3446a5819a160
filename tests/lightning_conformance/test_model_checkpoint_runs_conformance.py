"""Lightning 2.6.6's ``checkpointing/test_model_checkpoint.py`` promises
(tests/lightning_conformance/model_checkpoint_runs_program.py: exceptions, reruns, resumes, scores), one test per section, each against Lightning's own
recording of the same scenario."""

from __future__ import annotations

from typing import Any

import pytest
from lightning_compare import assert_section_matches

PROGRAM = "model_checkpoint_runs_program"


@pytest.mark.parametrize(
    "section",
    [
        "on_exception",
        "already_saved_on_exception",
        "save_last_checkpoint_contents",
        "version_after_rerun",
        "version_after_rerun_same_trainer",
        "version_counter_disabled",
        "saveload_ckpt",
        "expand_home",
        "checkpoint_repeated_strategy",
        "resume_training_preserves_old_ckpt_last",
        "load_with_inf_data_loader",
        "save_last_every_n_epochs_interaction",
        "save_last_without_validation",
        "save_last_only_when_checkpoint_saved",
        "current_score",
        "current_score_when_nan",
        "nan_as_first",
    ],
)
def test_section(observed: dict[str, Any], section: str) -> None:
    assert_section_matches(PROGRAM, observed, section)
