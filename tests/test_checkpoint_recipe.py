"""Distributed checkpoints end to end through `python recipes/smollm.py` (issue 8): a 3D run
(tp=2 x pp=2 x dp=2, ZeRO-1: 8 processes) SIGKILLed after a checkpoint resumes exactly; its
checkpoint resumes at other topologies; a kill midway through a save leaves `last` on the previous
good checkpoint; a truncated or missing shard is a fast error naming the file.

Every layout trains the same global batch of 8 sequences per step (micro_batch x accumulation x
dp), so its losses are comparable with the uninterrupted 3D run's."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from _ckpt_recipe import (
    RECIPE,
    command,
    env,
    read_last,
    sigkill_tree,
    tail,
    write_kill_wrapper,
)
from test_recipe_e2e import losses, recipe

STEPS = 6  # every run trains to this step
EVERY = 2  # the interrupted runs checkpoint every EVERY steps
RUN = [f"trainer.max_steps={STEPS}", "logger=csv", "trainer.accumulate_grad_batches=2"]
# global batch 8 = micro_batch_size x accumulate_grad_batches (2) x dp
LAYOUT_3D = [
    "trainer.micro_batch_size=2",
    "+parallel.tp=2",
    "+parallel.pp=2",
    "+parallel.dp=2",
    "+parallel.zero_stage=1",
]
SINGLE = ["trainer.micro_batch_size=4"]
# (smollm-tiny has 4 query / 2 kv heads: tp <= 2) tp 2 -> 1 and pp 2 -> 1, so each ZeRO-1
# partition now spans the whole model instead of one (tp, pp) shard of it
DP2_ZERO1 = ["trainer.micro_batch_size=2", "+parallel.dp=2", "+parallel.zero_stage=1"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("nanolight-cache")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    """The uninterrupted 3D run: losses of steps 1..STEPS, checkpoints at steps 3 and 6."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    recipe(run_dir, cache_dir, *RUN, *LAYOUT_3D, "checkpoint.every_n_steps=3")
    assert sorted(losses(run_dir)) == list(range(1, STEPS + 1))
    assert read_last(run_dir / "checkpoints") == f"step-{STEPS}"
    return run_dir


def assert_losses_match(run_dir: Path, reference: Path, first: int, rel: float) -> None:
    ref, got = losses(reference), losses(run_dir)
    assert set(range(first, STEPS + 1)) <= set(got), sorted(got)
    for step in range(first, STEPS + 1):
        assert got[step] == pytest.approx(ref[step], rel=rel, abs=0), (step, got[step], ref[step])


def copy_checkpoint(src: Path, run_dir: Path) -> Path:
    """A fresh run directory holding only checkpoint `src`, with `last` naming it."""
    ckpt_dir = run_dir / "checkpoints"
    ckpt_dir.mkdir(parents=True)
    shutil.copytree(src, ckpt_dir / src.name)
    (ckpt_dir / "last").write_text(src.name + "\n")
    return ckpt_dir / src.name


def step_dirs(ckpt_dir: Path) -> list[str]:
    return sorted(p.name for p in ckpt_dir.iterdir() if re.fullmatch(r"step-\d+", p.name))


def sigkill_after_the_first_checkpoint(tmp_path: Path, run_dir: Path, cache_dir: Path, *args: str) -> None:
    """Start the run and SIGKILL the launcher and its 8 ranks at once when step-EVERY is `last`."""
    ckpt_dir, log = run_dir / "checkpoints", tmp_path / "sigkill.log"
    cmd = command(RECIPE, run_dir, cache_dir, *args)
    with open(log, "w") as out:
        parent = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, env=env())
    try:
        deadline = time.monotonic() + 300
        while read_last(ckpt_dir) != f"step-{EVERY}":
            assert parent.poll() is None, f"the run ended before its first checkpoint:\n{tail(log)}"
            assert time.monotonic() < deadline, f"no checkpoint step-{EVERY} after 300 s:\n{tail(log)}"
            time.sleep(0.02)
        victims = sigkill_tree(parent)  # the launcher and all 8 ranks, at once
    finally:
        if parent.poll() is None:
            parent.kill()
        parent.wait()
    assert len(victims) == 1 + 8, victims
    assert parent.returncode == -9
    # killed before its next checkpoint (else this test did not test what it says)
    assert read_last(ckpt_dir) == f"step-{EVERY}", tail(log)


def kill_during_the_next_save(
    tmp_path: Path, run_dir: Path, cache_dir: Path, kill_rank: int, *args: str
) -> None:
    """Resume `run_dir` from `last` (step-EVERY) with global rank `kill_rank` SIGKILLing itself at its
    first write into checkpoint step-2*EVERY, while its peers may be further on in that save (rank 0,
    which also writes the trainer state; or the last rank, while rank 0 may be ready to commit); the
    launcher then stops the others. `last` must stay on step-EVERY, nothing named step-<N> half written."""
    log, marker = tmp_path / f"killed-{kill_rank}.log", tmp_path / f"killed-{kill_rank}-at.txt"
    ckpt_dir, second = run_dir / "checkpoints", 2 * EVERY
    # every rank runs the wrapper (the launcher re-launches it); only `kill_rank` is armed
    wrapper = write_kill_wrapper(tmp_path / f"kill_{kill_rank}.py", ckpt_dir, second, kill_rank, marker)
    cmd = command(wrapper, run_dir, cache_dir, *args, "checkpoint.resume=last")
    with open(log, "w") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, env=env(), timeout=300)
    assert proc.returncode != 0, tail(log)
    assert marker.exists(), f"rank {kill_rank} was not killed while saving step-{second}:\n{tail(log)}"
    assert len(marker.read_text().splitlines()) == 1, marker.read_text()
    assert read_last(ckpt_dir) == f"step-{EVERY}", (read_last(ckpt_dir), marker.read_text())
    assert step_dirs(ckpt_dir) == [f"step-{EVERY}"], sorted(p.name for p in ckpt_dir.iterdir())


@pytest.mark.slow
def test_3d_run_killed_from_outside_and_during_saves_resumes_exactly(
    tmp_path: Path, cache_dir: Path, reference: Path
) -> None:
    """One 3D run, four launches: SIGKILLed from outside after its first checkpoint (a node dying);
    resumed, rank 0 killed midway through the next save; resumed, the last rank killed midway
    through it; resumed to the end. Each kill leaves `last` on step-EVERY, and the last launch
    continues from it, next to whatever temporary files the kills left behind, with the
    uninterrupted run's losses; `keep_last_n` prunes across all of it."""
    run_dir = tmp_path / "run"
    ckpt_dir = run_dir / "checkpoints"
    keep = "checkpoint.keep_last_n=2"  # the newest 2 survive, across the kills and the resumes
    args = (*RUN, *LAYOUT_3D, f"checkpoint.every_n_steps={EVERY}", keep)
    sigkill_after_the_first_checkpoint(tmp_path, run_dir, cache_dir, *args)
    for kill_rank in (0, 7):
        kill_during_the_next_save(tmp_path, run_dir, cache_dir, kill_rank, *args)

    recipe(run_dir, cache_dir, *args, "checkpoint.resume=last")
    assert_losses_match(run_dir, reference, EVERY + 1, rel=1e-6)
    assert read_last(ckpt_dir) == f"step-{STEPS}"
    assert step_dirs(ckpt_dir) == [f"step-{STEPS - EVERY}", f"step-{STEPS}"]  # step-2 pruned


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["single", "dp2_zero1"])
def test_3d_checkpoint_resumes_at_another_topology(
    tmp_path: Path, cache_dir: Path, reference: Path, layout: str
) -> None:
    run_dir = tmp_path / layout
    copy_checkpoint(reference / "checkpoints" / "step-3", run_dir)
    overrides = SINGLE if layout == "single" else DP2_ZERO1
    recipe(run_dir, cache_dir, *RUN, *overrides, "checkpoint.every_n_steps=3", "checkpoint.resume=last")
    assert sorted(losses(run_dir)) == [4, 5, 6]
    assert_losses_match(run_dir, reference, 4, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_damaged_shard_is_a_fast_error_naming_the_file(
    tmp_path: Path, cache_dir: Path, reference: Path, damage: str
) -> None:
    run_dir = tmp_path / "run"
    step = copy_checkpoint(reference / "checkpoints" / "step-3", run_dir)
    shards = sorted(step.glob("*.safetensors"))
    assert shards, sorted(p.name for p in step.iterdir())
    if damage == "truncated":  # a model shard cut in half, resumed by two ranks (no rank may hang)
        victim = shards[0]
        with open(victim, "r+b") as f:
            f.truncate(victim.stat().st_size // 2)
        layout = DP2_ZERO1
    else:  # an optimizer shard (in the sharded format) gone, resumed in one process
        victim = shards[-1]
        victim.unlink()
        layout = SINGLE
    cmd = command(
        RECIPE, run_dir, cache_dir, *RUN, *layout, "checkpoint.every_n_steps=3", "checkpoint.resume=last"
    )
    try:  # a rank blocked in a collective would sit there for the 10-minute collective timeout
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env(), timeout=240)
    except subprocess.TimeoutExpired as err:
        raise AssertionError(f"resuming from a {damage} shard hung:\n{err.stderr}") from None
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert victim.name in proc.stderr, proc.stderr[-3000:]
    assert not (run_dir / "metrics.csv").exists() or not losses(run_dir), (
        "it trained from a broken checkpoint"
    )
