"""The one fixture every conformance test file shares: its program (the module's ``PROGRAM``) ported
by the renames and run once for the whole file, its observations kept."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from lightning_compare import run_ported


@pytest.fixture(scope="module")
def observed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    program = request.module.PROGRAM
    return run_ported(program, Path(tmp_path_factory.mktemp(program)))
