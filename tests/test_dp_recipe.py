"""`python recipes/smollm.py +parallel.dp=2 +parallel.zero_stage=1` from a plain shell: metrics.csv's
``train/loss`` (the mean over both dp ranks) equals the single-process run's, and the
single-process checkpoint resumes under dp=2 with ZeRO-1. (The other way, a dp=2 ZeRO-1
checkpoint resumed in one process with the same losses: `test_checkpoint_recipe.py`'s
``test_3d_checkpoint_resumes_at_another_topology[single]``, from tp2 x pp2 x dp2 with ZeRO-1.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from _dist import pythonpath
from test_recipe_e2e import REPO, losses, recipe


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("nanolight-cache")


@pytest.mark.slow
def test_recipe_dp2_zero1_matches_single_process_whose_checkpoint_resumes_at_dp2(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", pythonpath(REPO))  # this checkout, whatever `pip install -e` points at
    steps = [
        "trainer.max_steps=6",
        "checkpoint.every_n_steps=3",
        "logger=csv",
        "trainer.accumulate_grad_batches=2",
    ]
    single, dp2 = tmp_path / "single", tmp_path / "dp2"
    recipe(single, cache_dir, *steps, "trainer.micro_batch_size=4")
    # half the micro-batch per rank: the same global batch of 2 x 2 x 2 sequences of each step
    recipe(dp2, cache_dir, *steps, "trainer.micro_batch_size=2", "+parallel.dp=2", "+parallel.zero_stage=1")
    ref, got = losses(single), losses(dp2)
    assert sorted(got) == list(range(1, 7))
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), (step, got[step], ref[step])
    assert len(list(tmp_path.rglob("metrics.csv"))) == 2  # only global rank 0 logs

    # the single-process checkpoint resumes under dp=2 with ZeRO-1
    resumed = tmp_path / "resumed-dp2"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(single / "checkpoints" / "step-3", resumed / "checkpoints" / "step-3")
    (resumed / "checkpoints" / "last").write_text("step-3\n")
    zero = ["trainer.micro_batch_size=2", "+parallel.dp=2", "+parallel.zero_stage=1"]
    recipe(resumed, cache_dir, *steps, *zero, "checkpoint.resume=last")
    after = losses(resumed)
    assert sorted(after) == [4, 5, 6]
    for step, value in after.items():
        assert value == pytest.approx(ref[step], rel=1e-5), (step, value, ref[step])
