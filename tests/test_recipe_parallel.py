"""`python recipes/smollm.py +parallel.tp=2` from a plain shell: the same losses as the
single-process run, one metrics.csv, and a killed rank ends the whole job with an error."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _dist import pythonpath
from test_recipe_e2e import REPO, losses, recipe


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("nanolight-cache")


STEPS = ["trainer.max_steps=6", "checkpoint.every_n_steps=3", "logger=csv"]


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    """The single-process run both tp2 runs are held to: one run for the two."""
    run = tmp_path_factory.mktemp("single") / "single"
    recipe(run, cache_dir, *STEPS)
    return run


@pytest.mark.parametrize("sp", ["false", "true"])
def test_recipe_tp2_matches_single_process(tmp_path: Path, cache_dir: Path, single: Path, sp: str) -> None:
    tp2 = tmp_path / "tp2"
    recipe(tp2, cache_dir, *STEPS, "+parallel.tp=2", f"+parallel.sequence_parallel={sp}")
    ref, got = losses(single), losses(tp2)
    assert sorted(got) == list(range(1, 7))
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), (step, got[step], ref[step])
    assert len(list(tmp_path.rglob("metrics.csv"))) == 1  # only global rank 0 of the tp2 run logs
    assert (tp2 / "checkpoints" / "last").read_text().strip() == "step-6"


def _children(pid: int) -> list[int]:
    """Direct children of `pid`, read from /proc (no procps needed)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the process ended while we looked
        if int(fields[1]) == pid:  # field 4 of /proc/<pid>/stat is the parent pid
            kids.append(int(stat.parent.name))
    return sorted(kids)


@pytest.mark.slow
def test_killed_rank_ends_the_job(tmp_path: Path, cache_dir: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cmd = [
        sys.executable, str(REPO / "recipes" / "smollm.py"), f"trainer.default_root_dir={run_dir}",
        f"data.cache_dir={cache_dir}", "data.embedded_max_mb=2", "data.tokenizer_train_mb=1",
        "trainer.max_steps=100000", "trainer.seq_len=64", "trainer.micro_batch_size=4",
        "trainer.log_every_n_steps=1", "logger=csv", "+parallel.tp=2",
    ]  # fmt: skip
    parent = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": pythonpath(REPO)},
    )
    try:
        deadline = time.monotonic() + 180
        while not ((run_dir / "metrics.csv").exists() and len(_children(parent.pid)) == 2):
            assert parent.poll() is None and time.monotonic() < deadline, (
                "the tp=2 run never started training"
            )
            time.sleep(0.5)
        os.kill(_children(parent.pid)[1], signal.SIGKILL)
        killed_at = time.monotonic()
        code = parent.wait(timeout=60)
        assert code != 0
        assert time.monotonic() - killed_at < 60
    finally:
        if parent.poll() is None:
            parent.kill()
        parent.wait()
