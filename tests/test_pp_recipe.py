"""`python recipes/smollm.py +parallel.pp=2 +parallel.pp_schedule=1f1b`: the single-process
losses in metrics.csv, a checkpoint, and layout errors before any process starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from _dist import pythonpath
from test_recipe_e2e import REPO, losses, recipe

from nanolight.parallel.config import ParallelConfig
from nanolight.pretrain.config import ConfigError, PretrainConfig, TrainConfig
from nanolight.pretrain.run import check_layout


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("nanolight-cache")


STEPS = [
    "trainer.max_steps=4",
    "checkpoint.every_n_steps=2",
    "logger=csv",
    "trainer.accumulate_grad_batches=2",
]


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    """The single-process run every schedule is held to: one run for all three."""
    run = tmp_path_factory.mktemp("single") / "single"
    recipe(run, cache_dir, *STEPS)  # (`recipe` puts this checkout first on $PYTHONPATH)
    return run


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "afab", "interleaved_1f1b"])
def test_recipe_pp2_matches_single_process(
    tmp_path: Path, cache_dir: Path, single: Path, schedule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the recipe runs in a fresh interpreter outside the repo: import this checkout's nanolight,
    # not whatever an editable install elsewhere points at
    monkeypatch.setenv("PYTHONPATH", pythonpath(REPO))
    pp2 = tmp_path / "pp2"
    virtual = ["+parallel.pp_virtual=2"] if schedule == "interleaved_1f1b" else []
    recipe(pp2, cache_dir, *STEPS, "+parallel.pp=2", f"+parallel.pp_schedule={schedule}", *virtual)
    ref, got = losses(single), losses(pp2)
    assert sorted(got) == list(range(1, 5))
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), (step, got[step], ref[step])
    assert len(list(tmp_path.rglob("metrics.csv"))) == 1  # only global rank 0 of the pp2 run logs
    assert (pp2 / "checkpoints" / "last").read_text().strip() == "step-4"


def test_recipe_rejects_bad_pipeline_layouts() -> None:
    too_deep = PretrainConfig(parallel=ParallelConfig(pp=8))  # smollm-tiny has 4 layers
    with pytest.raises(ConfigError, match="pp=8 is larger than the model's num_hidden_layers=4"):
        check_layout(too_deep)
    few = PretrainConfig(parallel=ParallelConfig(pp=2), trainer=TrainConfig(accumulate_grad_batches=1))
    with pytest.raises(ConfigError, match="trainer.accumulate_grad_batches >= 2"):
        check_layout(few)
    check_layout(PretrainConfig(parallel=ParallelConfig(pp=2, pp_schedule="afab")))  # afab: fine
    interleaved = {"pp": 2, "pp_schedule": "interleaved_1f1b"}
    deep = PretrainConfig(parallel=ParallelConfig(**interleaved, pp_virtual=4))  # 8 chunks, 4 layers
    with pytest.raises(ConfigError, match=r"pp\*pp_virtual = 8 decoder layers.*choose pp_virtual <= 2"):
        check_layout(deep)
    odd = PretrainConfig(
        parallel=ParallelConfig(**interleaved, pp_virtual=2), trainer=TrainConfig(accumulate_grad_batches=3)
    )
    with pytest.raises(ConfigError, match=r"multiple of\s+pp=2 .*accumulate_grad_batches=2 or 4"):
        check_layout(odd)
