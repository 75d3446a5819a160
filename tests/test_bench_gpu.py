"""`scripts/bench_gpu.py` runs end to end on CPU with a tiny preset (the path a GPU run takes,
minus CUDA) on an interpreter where hydra, omegaconf, wandb, datasets and lightning-utilities
cannot be imported -- what the GPU box has: torch, transformers, safetensors."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

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


def _bench(*extra: str) -> tuple[list[list[str]], str]:
    """Run the bench on CPU, tiny, on a bare interpreter; its table rows (split) and stdout."""
    args = ["--device", "cpu", "--preset", "smollm-tiny", "--seq-len", "32", "--micro-batch", "1",
            "--steps", "1", "--warmup", "1", "--compile", "off", "--recompute", "none,full", *extra]  # fmt: skip
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
    return rows, done.stdout


def test_bench_gpu_runs_on_cpu_without_the_trainer_dependencies() -> None:
    rows, out = _bench("--precision", "bf16-mixed")
    assert [r[4] for r in rows] == ["bf16-mixed"] * 3, out
    assert len({r[-2] for r in rows}) == 1, out  # the same weights and precision: the same first loss
    assert "nanolight/transformers, compile off, nothing recomputed (bf16-mixed vs bf16-mixed):" in out


def test_bench_gpu_bf16_master_by_default_on_a_bare_interpreter() -> None:
    """nanolight's rows run bf16-master (no lightning-utilities needed), transformers' stay bf16-mixed."""
    rows, out = _bench()
    assert [r[4] for r in rows] == ["bf16-mixed", "bf16-master", "bf16-master"], out
    peer, *ours = (float(r[-2]) for r in rows)
    assert len(set(ours)) == 1, out  # recomputing changes nothing in the forward
    assert abs(ours[0] - peer) / peer < 1e-2, out  # the same weights, bf16 rounding apart
    assert "nothing recomputed (bf16-master vs bf16-mixed):" in out


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_gpu", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_gpu"] = bench  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    return bench


def test_bf16_master_step_is_adamw_on_fp32_masters_with_fp32_gradients() -> None:
    """The bench's bf16-master step against torch's own: AdamW (the same groups) stepping an fp32
    copy of the weights with the bf16 model's gradient taken in fp32, clipped by
    ``clip_grad_norm_``. The masters match it in fp32, the compute weights are them cast to bf16."""
    from nanolight.models import LlamaConfig
    from nanolight.parallel.zero import ZeroOptimizer, masters_in_model

    bench = _load_bench()
    device = torch.device("cpu")
    config = LlamaConfig.preset("smollm-tiny", attn_implementation="sdpa")
    ids = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    model = bench.nanolight_model(config, device)
    reference = bench.nanolight_model(config, device)  # the same seed: the same fp32 weights
    compute = bench.nanolight_model(config, device).to(torch.bfloat16)

    step = bench.TrainStep(model, lambda x: model(x, labels=x), "bf16-master", device)
    assert isinstance(step.optimizer, ZeroOptimizer) and step.optimizer.master_weights
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    step(ids)

    compute(ids, labels=ids).backward()
    for p, q in zip(reference.parameters(), compute.parameters(), strict=True):
        p.grad = q.grad.float()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), bench.CLIP)  # the loss is ~10: it clips
    bench.optimizer(reference, device).step()

    names = [n for n, _ in model.named_parameters()]
    with masters_in_model(step.strategy.optimizers):
        masters = [p.detach().clone() for p in model.parameters()]
    for name, got, want, weight in zip(
        names, masters, reference.parameters(), model.parameters(), strict=True
    ):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6, msg=name)
        assert torch.equal(weight.detach(), got.to(torch.bfloat16)), name


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
        ("NVIDIA GeForce RTX 4090", 165),  # Ada whitepaper, FP32 accumulate
        ("Tesla V100-SXM2-16GB", None),
    ],
)
def test_peak_flops_by_device_name(name: str, tflops: int | None) -> None:
    """NVIDIA's datasheet figures (with sparsity, halved): H100 SXM 1979, PCIe 1513, NVL 1671 --
    the planner's table, which ThroughputMonitor reads too (an NVL board is not an SXM one)."""
    peak = _load_bench().peak_bf16(name)
    assert (peak if peak is None else round(peak / 1e12)) == tflops


def test_the_time_limit_skips_a_run_that_would_end_past_it() -> None:
    """A run starts only if the longest one so far would still end before the deadline."""
    bench = _load_bench()
    limit = bench.TimeLimit(deadline=time.perf_counter() + 600)
    assert limit.allows_another()
    limit.record(30.0)
    assert limit.allows_another()
    limit.record(3600.0)  # a run of an hour would not end in time
    assert not limit.allows_another()


def test_the_headline_runs_nanolight_first_and_compares_one_precision() -> None:
    """`--headline` (what gpu_check runs first on a lent GPU): nanolight's rows before the peer's,
    so a time limit that cuts the run still leaves nanolight's figures; the ratio is taken at the
    peer's precision, not bf16-master against bf16-mixed."""
    args = ["--device", "cpu", "--preset", "smollm-tiny", "--seq-len", "32", "--micro-batch", "1",
            "--steps", "1", "--warmup", "1", "--compile", "off", "--headline"]  # fmt: skip
    done = subprocess.run([sys.executable, "-c", RUN, *args], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith("smollm-tiny  ")]
    assert [(r[1], r[4]) for r in rows] == [
        ("nanolight", "bf16-master"),
        ("nanolight", "bf16-mixed"),
        ("transformers", "bf16-mixed"),
    ], done.stdout
    assert "nothing recomputed (bf16-mixed vs bf16-mixed):" in done.stdout
