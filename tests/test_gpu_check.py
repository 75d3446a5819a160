"""`scripts/gpu_check.py` without a GPU: one clear line and a non-zero exit; its ``--cpu-dry-run``
runs the CPU-capable checks through the same code (also where only torch, transformers and
safetensors are installed: the trainer's checks then say SKIP); a failed check fails the run."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _dist import pythonpath

from nanolight.planner.layout import Layout
from nanolight.planner.search import Prediction

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.py"
ABSENT = ("hydra", "omegaconf", "wandb", "datasets", "lightning_utilities")

BARE_BOX = f"""
import importlib.abc, runpy, sys

class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {ABSENT!r}:
            raise ImportError(f"{{name}} is not installed on this box")

sys.meta_path.insert(0, Absent())
sys.argv = [{str(SCRIPT)!r}, *sys.argv[1:]]
runpy.run_path({str(SCRIPT)!r}, run_name="__main__")
"""


def _run(*args: str, bare: bool = False) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", BARE_BOX, *args] if bare else [sys.executable, str(SCRIPT), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath(REPO)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=500, cwd=REPO, env=env)


def _lines(out: str) -> dict[str, str]:
    """check name -> status, from the PASS/FAIL/SKIP lines."""
    rows = [line for line in out.splitlines() if line[:4] in ("PASS", "FAIL", "SKIP")]
    return {line[6:32].strip(): line[:4] for line in rows}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gets")
def test_without_cuda_one_line_and_a_nonzero_exit() -> None:
    done = _run()
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1 and "no CUDA device" in done.stderr and "--cpu-dry-run" in done.stderr


def test_cpu_dry_run_passes_every_cpu_check() -> None:
    done = _run("--cpu-dry-run")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    status = _lines(done.stdout)
    for name in (
        "sync-free model step",
        "sync-free trainer steps",
        "sync-free trainer master",
        "bf16-master vs bf16-mixed",
        "compile",
        "activation checkpointing",
        "fused AdamW",
        "planner smollm-tiny",
    ):
        assert status[name] == "PASS", done.stdout
    assert status["flash-attn dense"] == status["flash-attn varlen"] == "SKIP"
    assert "gpu_check: every check passed" in done.stdout


def test_cpu_dry_run_on_a_box_with_only_torch_transformers_safetensors() -> None:
    done = _run("--cpu-dry-run", bare=True)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    status = _lines(done.stdout)
    assert status["sync-free model step"] == status["compile"] == "PASS", done.stdout
    assert status["sync-free trainer steps"] == "SKIP" and "dependencies are not installed" in done.stdout
    assert status["planner smollm-tiny"] == "SKIP"


def _load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = gpu_check
    spec.loader.exec_module(gpu_check)
    return gpu_check


def test_a_failed_check_fails_the_run(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    gpu_check = _load_gpu_check()
    for name in ("sync_free_model", "compiled", "recompute", "bf16_master"):
        monkeypatch.setattr(gpu_check.Checks, name, lambda self: (True, 0.0, "stand-in"))
    monkeypatch.setattr(
        gpu_check.Checks, "sync_free_trainer", lambda self, precision: (True, 0.0, "stand-in")
    )
    monkeypatch.setattr(gpu_check.Checks, "flash", lambda self, documents: (True, 0.0, "stand-in"))
    monkeypatch.setattr(gpu_check.Checks, "planner", lambda self, preset: (True, 0.0, "stand-in"))
    monkeypatch.setattr(gpu_check.Checks, "fused_adamw", lambda self: (False, 0.5, "stand-in failure"))
    assert gpu_check.main(["--cpu-dry-run"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  fused AdamW" in out and "gpu_check: 1 failed: fused AdamW" in out


@pytest.mark.parametrize(
    ("memory", "step", "passes"),
    [(1.09, 0.81, True), (0.91, 1.19, True), (1.11, 1.0, False), (1.0, 0.79, False), (1.0, 1.21, False)],
)
def test_the_planner_check_holds_the_issue_tolerances(
    monkeypatch: pytest.MonkeyPatch, memory: float, step: float, passes: bool
) -> None:
    """Off the dry run, the planner's check passes only with the prediction's peak (its tracked
    parts: `max_memory_allocated` counts no allocator slack) within 10% of the measured one and its
    step within 20% (predicted / measured)."""
    gpu_check = _load_gpu_check()
    layout = Layout(micro_batch_size=4, accumulate_grad_batches=4, precision="bf16-master")
    parts = {"allocator": 2**27, "total": int(memory * 2**30) + 2**27}  # the margin is not compared
    best = Prediction(layout, parts, {"total": step * 0.5}, 1.0, 0.5, True)
    monkeypatch.setattr(gpu_check, "planned_run", lambda checks, preset, seq_len: (best, 2**30, 2**31, 0.5))
    checks = gpu_check.Checks(torch.device("cpu"), 8, dry_run=False)
    ok, number, what = checks.planner("smollm-135m")
    assert ok is passes and number == pytest.approx(memory), what
    assert f"{step:.2f}x" in what and "T=2048" in what and "micro_batch_size=4" in what


def test_the_benchmark_gets_what_is_left_of_the_budget(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """bench_gpu's --time-limit is the budget left less its start-up, and it is killed at the
    budget: an overrun is a failed check, not a run past the time the GPU is lent for."""
    gpu_check = _load_gpu_check()
    calls = []

    def overrun(cmd: list[str], cwd: Path, timeout: float) -> None:
        calls.append((cmd, timeout))
        raise subprocess.TimeoutExpired(cmd, timeout)

    monkeypatch.setattr(gpu_check.subprocess, "run", overrun)
    checks = gpu_check.Checks(torch.device("cpu"), 8, dry_run=True)
    gpu_check.run_bench(checks, left=300.0)
    ((cmd, timeout),) = calls
    assert cmd[-2:] == ["--time-limit", f"{300 - gpu_check.BENCH_START_UP:.0f}"] and timeout == 300.0
    assert checks.failed == ["bench_gpu"]
    assert "FAIL  bench_gpu.py" in capsys.readouterr().out
