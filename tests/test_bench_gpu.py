"""`scripts/bench_gpu.py` runs end to end on CPU with a tiny preset (the path a GPU run takes,
minus CUDA) on an interpreter where hydra, omegaconf, wandb, datasets and lightning-utilities
cannot be imported -- what the GPU box has: torch, transformers, safetensors."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "scripts" / "bench_gpu.py"
ABSENT = ("hydra", "omegaconf", "wandb", "datasets", "lightning_utilities")

RUN = f"""
import importlib.abc, runpy, sys

class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {ABSENT!r}:
            raise ImportError(f"{{name}} is not installed on this box")

sys.meta_path.insert(0, Absent())
sys.argv = [{str(BENCH)!r}, *sys.argv[1:]]
runpy.run_path({str(BENCH)!r}, run_name="__main__")
"""


def test_bench_gpu_runs_on_cpu_without_the_trainer_dependencies() -> None:
    args = ["--device", "cpu", "--preset", "smollm-tiny", "--seq-len", "32", "--micro-batch", "1",
            "--steps", "1", "--warmup", "1", "--compile", "off", "--recompute", "none,full"]  # fmt: skip
    done = subprocess.run([sys.executable, "-c", RUN, *args], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith("smollm-tiny  ")]
    assert [(r[1], r[3]) for r in rows] == [
        ("transformers", "none"),
        ("nanolight", "none"),
        ("nanolight", "full"),
    ]
    assert all(r[-1] == "ok" for r in rows), done.stdout
    assert len({r[-2] for r in rows}) == 1, done.stdout  # the same weights: the same first loss
    assert "nanolight/transformers, compile off, nothing recomputed:" in done.stdout


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", 989),  # SXM
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA H100 NVL", 835),
        ("NVIDIA H200", 989),
        ("NVIDIA H200 NVL", 835),
        ("NVIDIA GH200 480GB", 989),
        ("NVIDIA A100-SXM4-80GB", 312),
        ("NVIDIA A100 80GB PCIe", 312),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_peak_flops_by_device_name(name: str, tflops: int | None) -> None:
    """NVIDIA's datasheet figures (with sparsity, halved): H100 SXM 1979, PCIe 1513, NVL 1671."""
    spec = importlib.util.spec_from_file_location("bench_gpu", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_gpu"] = bench  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    peak = bench.peak_bf16(name)
    assert (peak if peak is None else round(peak / 1e12)) == tflops
