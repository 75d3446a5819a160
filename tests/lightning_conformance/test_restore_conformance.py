"""Lightning 2.6.6's ``models/test_restore.py`` promises (tests/lightning_conformance/restore_program.py), one
test per section, each against Lightning's own recording of the same scenario (and the one promise of
``checkpointing/test_trainer_checkpoint.py`` that applies, ``finetuning_with_ckpt_path``)."""

from __future__ import annotations

from typing import Any

import pytest
from lightning_compare import assert_section_matches

PROGRAM = "restore_program"


@pytest.mark.parametrize(
    "section",
    [
        "model_properties_fit_ckpt_path",
        "trainer_properties_restore_ckpt_path",
        "correct_step_and_epoch",
        "non_existing_checkpoint",
        "callbacks_state_fit_ckpt_path",
        "callbacks_references_fit_ckpt_path",
        "running_test_pretrained_model",
        "load_model_from_checkpoint",
        "model_saving_loading",
        "strict_model_load_more_params",
        "strict_model_load_less_params",
        "model_pickle",
        "finetuning_with_ckpt_path",
    ],
)
def test_section(observed: dict[str, Any], section: str) -> None:
    assert_section_matches(PROGRAM, observed, section)
