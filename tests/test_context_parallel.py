"""Context parallelism (cp): each rank of a cp group holds 1/cp of every sequence's tokens (zigzag
chunks) and ring attention joins them. The reference is one process at the same global batch:
losses, gradient norms and the weights after the run equal it to 1e-6 (fp32), on the hard data of
`test_token_mean` (many short packed documents with document masking, so the ranks' shares hold
different numbers of valid targets and attention crosses chunk boundaries inside a document).
Also: the checkpoint a cp run writes is the one-process model, the step's global batch does not
depend on cp, and bad input is one line.
"""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import pythonpath
from test_token_mean import GLOBAL, SEED, STEPS, _check_layout, _loader, _module, _single

from nanolight.errors import UsageError
from nanolight.parallel.config import ParallelConfig
from nanolight.parallel.ring_attention import zigzag_shard, zigzag_unshard


def test_cp2_equals_one_process(tmp_path: Path) -> None:
    _check_layout(tmp_path, tp=1, pp=1, dp=1, micro=1, cp=2)


@pytest.mark.slow
def test_dp2_cp2_zero1_equals_one_process(tmp_path: Path) -> None:
    _check_layout(tmp_path, tp=1, pp=1, dp=2, micro=1, cp=2, zero_stage=1)


@pytest.mark.slow
def test_tp2_sp_cp2_equals_one_process(tmp_path: Path) -> None:
    _check_layout(tmp_path, tp=2, pp=1, dp=1, micro=1, cp=2, sequence_parallel=True)


@pytest.mark.slow
def test_cp4_equals_one_process(tmp_path: Path) -> None:
    _check_layout(tmp_path, tp=1, pp=1, dp=1, micro=1, cp=4)  # chunks of 4 tokens: most cross a document


@pytest.mark.slow
def test_cp2_with_activation_checkpointing_and_compile_equals_one_process(tmp_path: Path) -> None:
    _check_layout(tmp_path, tp=1, pp=1, dp=1, micro=1, cp=2, activation_checkpointing="full", compile=True)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_pp2_cp2_equals_one_process(tmp_path: Path, schedule: str) -> None:
    _check_layout(tmp_path, tp=1, pp=2, dp=1, micro=2, cp=2, schedule=schedule)


# ---- checkpoints: cp2·dp2 -> one process -> cp4, and back ------------------------------------------
def _train(
    strategy: Any, dp: int, steps: int, root: str, load: str | None, save: str, keep: int = 1
) -> list[float]:
    """Train to `steps` (from the earliest checkpoint in `load`), each step's checkpoint saved in the loop
    (as a run's ModelCheckpoint does) to `root`/`save`, the newest `keep` kept; the losses of the steps run."""
    from _tiny import StepLosses

    from nanolight import NanoTrainer
    from nanolight.callbacks import ModelCheckpoint

    record, micro = StepLosses(), 1 if dp > 1 else 2
    rank = 0 if strategy.parallel.context is None else strategy.parallel.context.dp_rank
    saving = ModelCheckpoint(
        dirpath=Path(root) / save, every_n_train_steps=1, save_last=False, keep_last_n=keep
    )
    trainer = NanoTrainer(
        use_distributed_sampler=False, max_steps=steps, accumulate_grad_batches=GLOBAL // (dp * micro),
        gradient_clip_val=1.0, strategy=strategy, seed=SEED, logger=False, callbacks=[record, saving],
        enable_progress_bar=False,
    )  # fmt: skip
    load_path = None if load is None else str(min((Path(root) / load).iterdir()))
    trainer.fit(_module(), train_dataloaders=_loader(micro, dp, rank), ckpt_path=load_path)
    return record.losses


def _leg(
    rank: int, world: int, cp: int, steps: int, root: str, load: str | None, save: str, keep: int = 1
) -> Any:
    from nanolight.strategies.parallel3d import Parallel3DStrategy

    dp = world // cp
    strategy = Parallel3DStrategy(dp=dp, cp=cp, zero_stage=1 if dp > 1 else 0)
    strategy.setup_environment()
    losses = _train(strategy, dp, steps, root, load, save, keep)
    return losses if rank == 0 else None


@pytest.mark.slow
def test_checkpoints_cross_cp_layouts_and_resume_bit_exactly(tmp_path: Path) -> None:
    """Step 1 at cp2·dp2 (ZeRO-1), step 2 on one process, step 3 at cp4: the losses of the whole
    run are one process's (1e-6); and a cp2·dp2 run resumed at cp2·dp2 repeats its uninterrupted
    self bit for bit."""
    from _tiny import run_distributed

    from nanolight.strategies.base import SingleDeviceStrategy

    reference = _single(2)[0].losses
    # the uninterrupted cp2·dp2 run, every step's checkpoint kept: its step 1 is where the others start
    whole = run_distributed(_leg, 4, 2, STEPS, str(tmp_path), None, "a", STEPS, timeout=600, pg_timeout=90)[0]
    second = _train(SingleDeviceStrategy("cpu"), 1, 2, str(tmp_path), "a", "b")
    third = run_distributed(_leg, 4, 4, STEPS, str(tmp_path), "b", "c", timeout=600, pg_timeout=90)[0]
    torch.testing.assert_close(
        torch.tensor(whole[:1] + second + third), torch.tensor(reference), rtol=1e-6, atol=0
    )

    resumed = run_distributed(_leg, 4, 2, STEPS, str(tmp_path), "a", "e", timeout=600, pg_timeout=90)[0]
    assert resumed == whole[1:]  # the same layout: bit-exact


def test_zigzag_shards_put_back_together() -> None:
    x = torch.arange(2 * 24).view(2, 24)
    for cp in (1, 2, 3):
        parts = [zigzag_shard(x, r, cp) for r in range(cp)]
        assert torch.equal(zigzag_unshard(parts), x)
    assert zigzag_shard(x, 0, 2)[0].tolist() == [0, 1, 2, 3, 4, 5, 18, 19, 20, 21, 22, 23]


def test_bad_cp_input_is_one_line() -> None:
    with pytest.raises(UsageError, match=r"trainer.seq_len=30 is not divisible by 4"):
        ParallelConfig(cp=2).check_sequence(30)
    with pytest.raises(UsageError, match=r"each rank's 12 tokens .* over tp=8"):
        ParallelConfig(cp=2, tp=8, sequence_parallel=True).check_sequence(24)
    with pytest.raises(UsageError, match=r"parallel.cp=0 must be a positive integer"):
        ParallelConfig(cp=0)
    with pytest.raises(UsageError, match=r"world size 6 != tp\*pp\*cp\*dp = 1\*1\*2\*2 = 4"):
        ParallelConfig(cp=2, dp=2).check_world_size(6)


# ---- through the recipe: `+parallel.cp=2` from a plain shell ---------------------------------------
@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("nanolight-cache")


def _resume_from(tmp_path: Path, name: str, source: Path, cache: Path, *overrides: str) -> dict[int, float]:
    """Copy `source`'s step-3 checkpoint into a fresh run directory and continue it to step 6."""
    from test_recipe_e2e import losses, recipe

    run = tmp_path / name
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(source / "checkpoints" / "step-3", run / "checkpoints" / "step-3")
    (run / "checkpoints" / "last").write_text("step-3\n")
    recipe(run, cache, *overrides, "checkpoint.resume=last")
    return losses(run)


@pytest.mark.slow
def test_recipe_cp2_matches_one_process_and_checkpoints_cross_layouts(
    tmp_path: Path, cache_dir: Path
) -> None:
    """Document masking (attention stops at every document boundary, across the chunks), validation,
    the greedy sample, and checkpoints: a cp2 checkpoint continues on one process and a one-process
    checkpoint under cp2, each with the losses the uninterrupted run had."""
    from test_recipe_e2e import losses, recipe

    steps = ["trainer.max_steps=6", "checkpoint.every_n_steps=3", "logger=csv", "data.document_mask=true"]
    single, cp2 = tmp_path / "single", tmp_path / "cp2"
    one = recipe(single, cache_dir, *steps)
    two = recipe(cp2, cache_dir, *steps, "+parallel.cp=2")
    ref, got = losses(single), losses(cp2)
    assert sorted(got) == list(range(1, 7))
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), (step, got[step], ref[step])
    val = [_column(d, "val/loss") for d in (single, cp2)]
    assert len(val[0]) == 2 and val[1] == pytest.approx(val[0], rel=1e-5)  # before step 1, after step 6
    sample = [line for line in one.stdout.splitlines() if line.startswith("step 6 sample:")]
    assert sample and sample[0] in two.stdout  # greedy decoding through the ring picks the same tokens

    for step, value in _resume_from(tmp_path, "cp2-to-one", cp2, cache_dir, *steps).items():
        assert value == pytest.approx(ref[step], rel=1e-5), (step, value, ref[step])
    after = _resume_from(tmp_path, "one-to-cp2", single, cache_dir, *steps, "+parallel.cp=2")
    assert sorted(after) == [4, 5, 6]
    for step, value in after.items():
        assert value == pytest.approx(ref[step], rel=1e-5), (step, value, ref[step])


def _column(run: Path, name: str) -> list[float]:
    with open(run / "metrics.csv") as f:
        return [float(r[name]) for r in csv.DictReader(f) if r.get(name)]


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (
            ["trainer.seq_len=30"],
            "context parallelism cp=2 cuts each sequence into 2*cp = 4 equal chunks, but trainer.seq_len=30 "
            "is not divisible by 4; choose a multiple of it",
        ),
        (
            ["trainer.precision=bf16-master"],
            "precision='bf16-master' keeps its fp32 master weights in the ZeRO-1 optimizer: with 2 replicas "
            "(dp x cp) set zero_stage=1 (the same traffic as plain data parallelism, 1/replicas of the "
            "optimizer state)",
        ),
    ],
)
def test_recipe_refuses_what_cp_cannot_run_in_one_line(
    tmp_path: Path, overrides: list[str], line: str
) -> None:
    from test_recipe_e2e import REPO

    recipe = str(REPO / "recipes" / "smollm.py")
    cmd = [sys.executable, recipe, f"trainer.default_root_dir={tmp_path}", "+parallel.cp=2", *overrides]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": pythonpath(REPO)}
    )
    assert proc.returncode != 0
    lines = [text for text in proc.stderr.splitlines() if text.strip()]
    assert lines == [f"nanolight: error: {line}"], proc.stderr[-2000:]


def test_cp_refuses_batches_it_cannot_split() -> None:
    from nanolight.strategies.parallel3d import Parallel3DStrategy

    strategy = Parallel3DStrategy(cp=2)  # not started: the batch is refused before any rank is asked
    with pytest.raises(UsageError, match=r"needs a dict with input_ids \(B, T\).*got tuple"):
        strategy.shard_batch((torch.zeros(2, 8), torch.zeros(2)))
    with pytest.raises(UsageError, match=r"seq_len=6 is not divisible by 4"):
        strategy.shard_batch({"input_ids": torch.zeros(2, 6, dtype=torch.long)})
    ids = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(UsageError, match=r"give the batch target_ids .* instead of labels="):
        strategy.shard_batch({"input_ids": ids, "labels": ids})
