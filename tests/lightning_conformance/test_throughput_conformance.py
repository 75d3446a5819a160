"""Lightning 2.6.6's ``callbacks/test_throughput_monitor.py`` promises
(tests/lightning_conformance/throughput_program.py, on a fake clock), one test per section, each against
Lightning's own recording of the same scenario; the rows every section logged are compared too."""

from __future__ import annotations

from typing import Any

import pytest
from lightning_compare import assert_files_match, assert_section_matches

PROGRAM = "throughput_program"


def test_logged_rows(observed: dict[str, Any]) -> None:
    """Every row each section's monitor logged: keys, values, steps and epochs."""
    assert_files_match(PROGRAM, observed)


@pytest.mark.parametrize(
    "section",
    [
        "measure_flops_section",
        "fit",
        "fit_with_validation",
        "fit_no_length_fn",
        "fit_gradient_accumulation",
        "evaluation",
        "variable_batch_size",
        "variable_batch_size_with_validation",
        "validation_with_many_epochs",
        "warn_once",
    ],
)
def test_section(observed: dict[str, Any], section: str) -> None:
    assert_section_matches(PROGRAM, observed, section)
