"""The surface a language-model script uses beyond the loop (tests/lightning_programs/lm_surface.py):
``grad_norm``, ``LambdaCallback``, ``Timer``, ``ThroughputMonitor(batch_size_fn, ...)`` and
``measure_flops``, each section against what Lightning 2.6.6 did
(tests/fixtures/lightning/lm_surface.json). Timer and ThroughputMonitor run on a fake clock the
program's module advances, so elapsed times, stopping points and rates compare exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from lightning_compare import assert_section_matches, differences, fixture, run_ported

PROGRAM = "lm_surface"


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_ported(PROGRAM, Path(tmp_path_factory.mktemp(PROGRAM)))


def _check(observed: dict[str, Any], section: str) -> None:
    assert_section_matches(PROGRAM, observed, section)


def _check_csv(observed: dict[str, Any], section: str) -> None:
    want = {k: v for k, v in fixture(PROGRAM)["csv"].items() if k.startswith(f"{section}/")}
    got = {k: v for k, v in observed["csv"].items() if k.startswith(f"{section}/")}
    assert want, f"no metrics.csv recorded for {section}"
    diffs = differences(want, got)
    assert not diffs, f"{section} metrics.csv: {len(diffs)} differences:\n" + "\n".join(diffs[:20])


def test_grad_norm_keys_values_and_logging(observed: dict[str, Any]) -> None:
    """Lightning's keys (``grad_2.0_norm/layer.weight``, ``grad_2.0_norm_total``), parameters
    without a gradient left out, the separator, the ``norm_type=0`` error, and the rows it makes
    when logged from ``on_before_optimizer_step``."""
    _check(observed, "grad_norm_section")
    _check_csv(observed, "grad_norm_section")


def test_lambda_callback_calls_each_hook_with_lightnings_arguments(observed: dict[str, Any]) -> None:
    """Every hook given as a keyword runs at its place with Lightning's arguments (``setup`` and
    ``teardown`` get ``stage=`` by keyword); an unknown keyword is a TypeError naming it."""
    _check(observed, "lambda_callback")


@pytest.mark.parametrize("section", ["timer_step", "timer_epoch", "timer_zero", "timer_resume", "timer_bad"])
def test_timer(observed: dict[str, Any], section: str) -> None:
    """Stops at Lightning's checks (each training batch end, each epoch end, fit start: a zero
    budget trains nothing), per-stage start/end/elapsed, and the elapsed training time restored on
    resume."""
    _check(observed, section)


def test_throughput_monitor_with_lightnings_arguments(observed: dict[str, Any]) -> None:
    """``train/...`` rows on logging steps (validation time excluded), ``validate/...`` and
    ``test/...`` rows every ``log_every_n_steps``-th batch at that count, rates once the window is
    full, FLOPs from ``flops_per_batch``."""
    _check(observed, "throughput")
    _check_csv(observed, "throughput")


def test_measure_flops(observed: dict[str, Any]) -> None:
    _check(observed, "flops")
