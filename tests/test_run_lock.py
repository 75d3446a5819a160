"""One run per run directory ("nothing lost", item 2): a second run started in a directory a live
run holds fails at once with one line, before writing anything; a killed run (SIGKILL: no
clean-up ran) leaves no stuck lock, because the kernel drops an ``flock`` with its process."""

from __future__ import annotations

import csv
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _ckpt_recipe import command, env, sigkill_tree
from test_recipe_e2e import REPO

RECIPE = REPO / "recipes" / "smollm.py"
LINE = "nanolight: error: run directory {} is in use by another run"
HOLD = "import sys, time; from pathlib import Path; from nanolight.pretrain.lock import run_lock\n" \
    "with run_lock(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(600)\n"  # fmt: skip


def test_lock_refuses_a_second_holder_and_dies_with_its_process(tmp_path: Path) -> None:
    from nanolight.pretrain.lock import RunDirectoryInUse, run_lock

    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env()
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(
            RunDirectoryInUse, match=f"run directory {tmp_path} is in use by another run .pid {holder.pid}"
        ):
            with run_lock(tmp_path):
                pass
    finally:
        holder.send_signal(signal.SIGKILL)  # no clean-up runs: the kernel releases the lock
        holder.wait()
    with run_lock(tmp_path):  # free again
        with pytest.raises(RunDirectoryInUse):  # and held while the body runs (another open file counts)
            with run_lock(tmp_path):
                pass


def _steps(run_dir: Path) -> list[int]:
    with open(run_dir / "metrics.csv") as f:
        return [int(r["step"]) for r in csv.DictReader(f) if r.get("train/loss")]


@pytest.mark.slow
def test_two_runs_at_once_in_one_directory(tmp_path: Path) -> None:
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    cmd = command(RECIPE, run_dir, cache, "trainer.max_steps=4", "logger=csv", "checkpoint.every_n_steps=2")
    # prepare the data cache first, so both runs reach the lock at the same moment
    subprocess.run([*cmd[:2], f"trainer.default_root_dir={tmp_path / 'warm'}", *cmd[3:], "trainer.max_steps=1"],
                   env=env(), check=True, capture_output=True, timeout=300)  # fmt: skip
    procs = [
        subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes[0] == 0 and codes[1] != 0, [
        (p.returncode, e[-2000:]) for p, (_, e) in zip(procs, outs, strict=True)
    ]
    loser_err = next(e for p, (_, e) in zip(procs, outs, strict=True) if p.returncode != 0)
    errors = [line for line in loser_err.splitlines() if line.startswith("nanolight: error:")]
    assert len(errors) == 1 and errors[0].startswith(LINE.format(run_dir)), loser_err[-2000:]
    assert "Traceback" not in loser_err
    assert _steps(run_dir) == [0, 1, 2, 3]  # one run's rows, once each
    assert (run_dir / "checkpoints" / "last").read_text().strip() == "step-4"


@pytest.mark.slow
def test_a_sigkilled_multi_process_run_leaves_no_stuck_lock(tmp_path: Path) -> None:
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    run_dir.mkdir()
    layout = ("+parallel.dp=2", "trainer.micro_batch_size=2", "logger=csv", "checkpoint.every_n_steps=2")
    first = subprocess.Popen(command(RECIPE, run_dir, cache, "trainer.max_steps=100000", *layout), env=env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "checkpoints" / "last").exists():
            assert first.poll() is None and time.monotonic() < deadline, "the first run never saved"
            time.sleep(0.3)
        # while it runs, a second run is refused (the launcher parent holds the lock for its ranks)
        second = subprocess.run(command(RECIPE, run_dir, cache, "checkpoint.resume=last", *layout), env=env(),
                                capture_output=True, text=True, timeout=120)  # fmt: skip
        assert second.returncode != 0 and LINE.format(run_dir) in second.stderr, second.stderr[-2000:]
    finally:
        sigkill_tree(first)
    third = subprocess.run(command(RECIPE, run_dir, cache, "trainer.max_steps=6", "checkpoint.resume=last", *layout),
                           env=env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert third.returncode == 0, third.stderr[-3000:]
