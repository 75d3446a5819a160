"""Resume after SIGKILL is bit-identical to an uninterrupted run (fp32, CPU, AdamW + LambdaLR,
shuffled plain DataLoader, checkpoint mid-epoch, dropout, run crossing an epoch boundary)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _resume_run import run as run_in_process

SCRIPT = Path(__file__).parent / "_resume_run.py"
REPO = Path(__file__).parent.parent


def _run(root: Path, max_steps: int, kill_at: int = 0, resume: str = "-") -> int:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(root), str(max_steps), str(kill_at), resume],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if proc.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(f"run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.returncode


def _losses(root: Path) -> dict[int, str]:
    lines = (root / "losses.txt").read_text().split()
    return {int(s): h for s, h in zip(lines[::2], lines[1::2], strict=True)}


@pytest.mark.slow  # ~25 s: two fresh interpreters (torch import) + one in-process run
def test_sigkill_resume_is_bit_identical(tmp_path):
    steps, kill_at = 12, 6  # 8 optimizer steps per epoch: checkpoint mid-epoch, resume crosses an epoch
    full, crashed = tmp_path / "full", tmp_path / "crashed"
    run_in_process(full, steps, 0, "-")  # the reference run needs no subprocess
    assert _run(crashed, steps, kill_at=kill_at) == -signal.SIGKILL
    assert not (crashed / "final.pt").exists()
    assert (crashed / "checkpoints" / "last").read_text().strip() == f"step-{kill_at}"
    assert _run(crashed, steps, resume="last") == 0

    assert _losses(crashed) == _losses(full)  # float.hex: exact
    assert sorted(_losses(full)) == list(range(1, steps + 1))
    a = torch.load(full / "final.pt", weights_only=True)
    b = torch.load(crashed / "final.pt", weights_only=True)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # keep_last_n=2 plus atomic writes: no temp dirs left, only the newest two
    names = sorted(p.name for p in (crashed / "checkpoints").iterdir())
    assert names == ["last", "step-12", "step-9"]


def test_in_process_resume_matches(tmp_path):
    """Fast variant (default test run): stop at step 6 by max_steps, resume from `last` to 12."""
    full, split = tmp_path / "full", tmp_path / "split"
    run_in_process(full, 12, 0, "-")
    run_in_process(split, 6, 0, "-")
    run_in_process(split, 12, 0, "last")
    assert _losses(split) == _losses(full)
    a = torch.load(full / "final.pt", weights_only=True)
    b = torch.load(split / "final.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
