"""Every test runs under the NCCL emulation (``_nccl_emulation``), with nothing to opt into.

Ranks started by `run_distributed` are checked by it. Every other Python process a test starts
(``python recipes/...``, which re-launches itself as N ranks; torchrun's workers) inherits
``_nccl_site/`` on $PYTHONPATH, whose ``sitecustomize`` records it and, at the clean end of a rank,
writes its recording under $NANOLIGHT_NCCL_RECORD (a directory per test). When the test passes,
each world all of whose ranks wrote one is checked, and the test fails with what NCCL would hang
on. A world with a rank that did not write (killed, crashed, raised: the fault tests) is skipped.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from pathlib import Path

import pytest
from _nccl_emulation import ENV, assert_nccl_safe, recorded_worlds

SITE = str(Path(__file__).resolve().parent / "_nccl_site")


@pytest.fixture(autouse=True)
def nccl_record(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path_factory.mktemp("nccl-record")
    monkeypatch.setenv(ENV, str(directory))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([SITE, *filter(None, [os.environ.get("PYTHONPATH")])]))
    return directory


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    result = yield  # raises if the test failed: nothing to add then
    directory = os.environ.get(ENV)
    for key, recordings in recorded_worlds(Path(directory)).items() if directory else ():
        try:
            assert_nccl_safe(recordings)
        except AssertionError as err:
            raise AssertionError(f"the world of {len(recordings)} rank(s) at {key}: {err}") from None
    return result
