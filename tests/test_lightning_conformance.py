"""Lightning-conformance scenarios (tests/lightning_programs/conformance.py), one test per section,
each against what Lightning 2.6.6 itself did (tests/fixtures/lightning/conformance.json). The
program is ported by the renames alone and run once for the whole file; a section that raised under
nanolight records its error, so each test names the one behaviour that differs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from lightning_compare import assert_section_matches, run_ported

PROGRAM = "conformance"


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_ported(PROGRAM, Path(tmp_path_factory.mktemp(PROGRAM)))


def _check(observed: dict[str, Any], section: str) -> None:
    assert_section_matches(PROGRAM, observed, section)


def test_early_stopping_on_train_epoch_end_sees_what_the_module_logged(observed: dict[str, Any]) -> None:
    """Monitoring callbacks run their on_train_epoch_end after the module's (Lightning's
    ``fit_loop.on_advance_end``: non-monitoring callbacks, the module, then EarlyStopping/Checkpoint)."""
    _check(observed, "epoch_end_monitor")


def test_fit_twice_continues_with_raised_max_epochs(observed: dict[str, Any]) -> None:
    """Lightning's ``test_restore.py::test_fit_twice``: epochs [0, 1] then [2, 3]."""
    _check(observed, "fit_twice")


def test_should_stop_with_min_steps_finishes_the_epoch(observed: dict[str, Any]) -> None:
    """``min_steps`` without ``min_epochs`` implies ``min_epochs=1`` (Lightning's ``_parse_loop_limits``)."""
    _check(observed, "min_steps_stop")


def test_state_dict_override_without_arguments(observed: dict[str, Any]) -> None:
    _check(observed, "state_dict_override")


def test_hparams_reload_dict_dataclass_and_strict_false(observed: dict[str, Any]) -> None:
    _check(observed, "hparams_reload")


def test_clip_gradients_clips_only_that_optimizers_parameters(observed: dict[str, Any]) -> None:
    _check(observed, "clip_two_optimizers")


def test_no_extra_train_call_after_the_sanity_check(observed: dict[str, Any]) -> None:
    _check(observed, "train_calls")


def test_setup_and_teardown_receive_trainer_fn(observed: dict[str, Any]) -> None:
    _check(observed, "setup_stage")


def test_resume_mid_epoch_hooks_and_counters(observed: dict[str, Any]) -> None:
    """Restored after ``on_fit_start`` (Lightning's ``_run``: ``_run_stage`` restores the training
    state after ``on_fit_start``), and no ``on_train_epoch_start`` for the resumed epoch."""
    _check(observed, "resume_mid_epoch")
