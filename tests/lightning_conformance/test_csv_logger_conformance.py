"""Lightning 2.6.6's ``loggers/test_csv.py`` promises (tests/lightning_conformance/csv_logger_program.py),
one test per section, each against Lightning's own recording of the same scenario."""

from __future__ import annotations

from typing import Any

import pytest
from lightning_compare import assert_files_match, assert_section_matches

PROGRAM = "csv_logger_program"


def test_metrics_and_hparams_files(observed: dict[str, Any]) -> None:
    """Every metrics.csv (rows, header) and hparams.yaml the sections wrote."""
    assert_files_match(PROGRAM, observed)


@pytest.mark.parametrize(
    "section",
    [
        "automatic_versioning",
        "manual_versioning",
        "named_version",
        "no_name",
        "log_metrics",
        "log_hyperparams",
        "fit_csv_logger",
        "flush_n_steps",
        "metrics_reset_after_save",
        "append_metrics_file",
        "append_columns",
    ],
)
def test_section(observed: dict[str, Any], section: str) -> None:
    assert_section_matches(PROGRAM, observed, section)
