"""Ctrl-C in the recipe is a pre-emption ("nothing lost", item 3): the ranks finish the step, save,
and the run exits 130 with one line; a second Ctrl-C stops at once (130, one line, no traceback).

A terminal's Ctrl-C reaches the whole foreground process group: here the recipe runs in a session
of its own (``start_new_session=True``) and the test signals that group, launcher and ranks alike.
(A plain `NanoTrainer` keeps Lightning's meaning: ``KeyboardInterrupt``, ``on_exception``, no save.)"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from _ckpt_recipe import RECIPE, command, env, read_last
from test_preemption import _losses_or_empty

DP2 = ("+parallel.dp=2", "trainer.micro_batch_size=2")


def _interrupt(tmp_path: Path, layout: tuple[str, ...], presses: int) -> tuple[int, str, Path]:
    """Start a long run in its own session, Ctrl-C its process group `presses` times once it trains."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cmd = command(RECIPE, run_dir, tmp_path / "cache", "trainer.max_steps=100000", "logger=csv",
                  "checkpoint.every_n_steps=100000", "trainer.enable_progress_bar=false", *layout)  # fmt: skip
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while len(_losses_or_empty(run_dir)) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, "the run never started training"
            time.sleep(0.3)
        for _ in range(presses):
            os.killpg(proc.pid, signal.SIGINT)  # what the terminal does
            time.sleep(0.05)
        _, err = proc.communicate(timeout=120)
        return proc.returncode, err, run_dir
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize("layout", [(), DP2], ids=["one-process", "dp2-launcher"])
def test_ctrl_c_saves_then_exits_130(tmp_path: Path, layout: tuple[str, ...]) -> None:
    code, err, run_dir = _interrupt(tmp_path, layout, presses=1)
    assert code == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    saved = [line for line in err.splitlines() if "SIGINT received: finished step" in line]
    assert len(saved) == 1, err[-3000:]
    step = int(saved[0].split("finished step ")[1].split(",")[0])
    assert read_last(run_dir / "checkpoints") == f"step-{step}"
    assert max(_losses_or_empty(run_dir)) == step  # nothing ran after the saved step


@pytest.mark.slow
@pytest.mark.parametrize("layout", [(), DP2], ids=["one-process", "dp2-launcher"])
def test_second_ctrl_c_stops_at_once(tmp_path: Path, layout: tuple[str, ...]) -> None:
    code, err, _ = _interrupt(tmp_path, layout, presses=2)
    assert code == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert len([line for line in err.splitlines() if "Ctrl-C again: stopped" in line]) == 1, err[-3000:]
