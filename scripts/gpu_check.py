"""The headline figure first, then every check that needs a GPU, in one prepared run: the whole
run within ``--budget`` seconds (default 450: under 8 minutes with the start-up).

    python scripts/gpu_check.py                  # on a CUDA machine; exit status 1 if any check failed
    python scripts/gpu_check.py --cpu-dry-run    # the checks that make sense on a CPU, tiny sizes, no
                                                 # benchmark: proves this script's code paths (a test runs it)

A lent GPU may be lent for minutes only, so what it is lent for comes first: `scripts/bench_gpu.py
--headline` -- nanolight, then transformers at the same precision, each compiled, on smollm-1.7b
then smollm-360m: tokens/s and MFU over timed steps after untimed warm-ups (compilation happens in
those) -- in `HEADLINE_SHARE` of the budget as its ``--time-limit`` (it starts a run only if it would
end in time; killed if it still overruns). Each row is printed as it finishes, so whatever the
budget cuts later, the figures printed stand. Then the checks: the CPU test suite cannot see what
only CUDA does (a host sync inside a training step, flash-attn's kernels, inductor's code, the
fused AdamW kernel); each prints one line as it finishes -- PASS / FAIL / SKIP, its name, the
number it measured and what was compared.

- sync-free step: the model's train step (forward, backward, clipping, fused AdamW) under
  ``torch.cuda.set_sync_debug_mode("error")``, with packed documents; and, when the trainer's
  dependencies are installed, the trainer's quiet steps (tests/test_sync_free.py's CUDA variant)
  in ``bf16-mixed`` and in ``bf16-master`` (the recipe's GPU default: ZeRO's masters, fp32 buckets);
- flash-attn dense and varlen (packed documents) against SDPA, bf16, when flash-attn is installed;
- compile: each block compiled, the losses of a few steps against eager;
- activation checkpointing (full, selective): gradients equal to the plain backward's;
- fused AdamW against the foreach one, from the same gradients;
- the ``bf16-master`` precision against ``bf16-mixed``: the trainer's losses over 8 steps, having
  checked that it did train bf16 weights with fp32 masters;
- the layout planner against real runs (issue 22's GPU proof): for smollm-135m and smollm-360m on
  this GPU at T=2048, the planner's pick for one GPU (`nanolight.planner.search.plan`: the
  device's table figures, the host's cost per block measured on it, `hardware.at_hand`) runs 20
  steps in NanoTrainer; its predicted peak memory must be
  within 10% of ``torch.cuda.max_memory_allocated`` and its step time within 20% of the measured
  median (`nanolight.pretrain.auto.PredictionCheck`, the measurement ``+parallel=auto`` prints).
  The dry run plans smollm-tiny on this CPU, measured, and compares nothing.

Needs only torch, transformers and safetensors: nanolight is imported part by part (its top level
is lazy), and the checks that need the trainer say SKIP where its dependencies are missing.
"""

from __future__ import annotations

import argparse
import copy
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # a source checkout, not installed
from nanolight.models import PRESETS, LlamaConfig, LlamaForCausalLM, flash_attn_available  # noqa: E402
from nanolight.parallel.blocks import apply_activation_checkpointing, compile_blocks  # noqa: E402
from nanolight.parallel.ring_kernels import Block, MathKernel, block_kernel  # noqa: E402

NO_CUDA = (
    "gpu_check: no CUDA device (torch {version}, CUDA {cuda}): run it on a GPU machine, or pass "
    "--cpu-dry-run to run the checks that make sense on a CPU"
)


class Skip(Exception):
    """A check that cannot run here (a missing package, a CPU): printed as SKIP, not a failure."""


class Checks:
    """The checks, on `device` with `seq_len`-token rows; results collected as printed lines."""

    def __init__(self, device: torch.device, seq_len: int, dry_run: bool) -> None:
        self.device, self.seq_len, self.dry_run = device, seq_len, dry_run
        self.failed: list[str] = []
        g = torch.Generator().manual_seed(0)
        self.config = LlamaConfig(**PRESETS["smollm-tiny"])
        self.ids = torch.randint(0, self.config.vocab_size, (2, seq_len), generator=g).to(device)
        # three packed documents per row, of uneven lengths
        cuts = torch.tensor([seq_len // 5, seq_len // 2])
        self.docs = (
            torch.bucketize(torch.arange(seq_len), cuts, right=True).expand(2, -1).contiguous().to(device)
        )

    # ---- helpers -----------------------------------------------------------------------------
    def model(self, **overrides: Any) -> LlamaForCausalLM:
        torch.manual_seed(0)  # the same weights every time
        config = LlamaConfig(**{**PRESETS["smollm-tiny"], **overrides})
        with torch.device(self.device):
            return LlamaForCausalLM(config).train()

    def autocast(self, bf16: bool) -> Any:
        return torch.autocast(self.device.type, dtype=torch.bfloat16) if bf16 else nullcontext()

    def steps(
        self, model: torch.nn.Module, n: int, bf16: bool = False, documents: bool = False
    ) -> list[torch.Tensor]:
        """`n` training steps (forward, backward, clip, AdamW); the losses, left on the device."""
        opt = adamw(model, self.device)
        losses = []
        for _ in range(n):
            with self.autocast(bf16):
                loss = model(self.ids, labels=self.ids, document_ids=self.docs if documents else None)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        return losses

    def run(self, name: str, check: Callable[[], tuple[bool, float, str]]) -> None:
        start = time.perf_counter()
        try:
            ok, number, what = check()
            status = "PASS" if ok else "FAIL"
        except Skip as why:
            status, number, what = "SKIP", float("nan"), str(why)
        except Exception as exc:  # a crash is a failed check, named, and the others still run
            status, number, what = (
                "FAIL",
                float("nan"),
                f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}",
            )
        if status == "FAIL":
            self.failed.append(name)
        print(
            f"{status}  {name:<26} {number:>11.3g}  {what} ({time.perf_counter() - start:.1f} s)", flush=True
        )

    # ---- the checks --------------------------------------------------------------------------
    def sync_free_model(self) -> tuple[bool, float, str]:
        model = self.model()
        self.steps(model, 1, bf16=True, documents=True)  # warm-up: allocations, caches, the tables
        n = 3
        with sync_debug("error" if self.device.type == "cuda" else None):
            losses = self.steps(model, n, bf16=True, documents=True)
        ok = bool(torch.isfinite(torch.stack(losses)).all())
        mode = "no sync raised" if self.device.type == "cuda" else "dry run: no CUDA sync checking"
        return ok, n, f"train steps with packed documents, bf16 autocast, fused AdamW ({mode})"

    def ring_block_kernel(self) -> tuple[bool, float, str]:
        """Context parallelism's fused block kernel (PyTorch's flash kernel returning the
        log-sum-exp) against the exact math one, forward and backward, in bf16."""
        g = torch.Generator().manual_seed(0)
        shape = (2, 4, self.seq_len // 2, 64)
        q, k, v, do = (torch.randn(shape, generator=g).to(self.device, torch.bfloat16) for _ in range(4))
        worst = 0.0
        for causal in (True, False):
            fused, math, block = (
                block_kernel(q, masked=False),
                MathKernel(),
                Block(q, k, v, causal, None, 0.125),
            )
            out, lse = fused.forward(block)
            ref_out, ref_lse = math.forward(block)
            grads = fused.backward(block, do, ref_out, ref_lse)
            ref_grads = math.backward(block, do, ref_out, ref_lse)
            for a, b in [(out, ref_out), (lse, ref_lse), *zip(grads, ref_grads, strict=True)]:
                worst = max(worst, float((a.float() - b).abs().max() / b.abs().max()))
        name = type(fused).__name__
        return worst < 2e-2, worst, f"{name} vs MathKernel, causal and full blocks, bf16 (max error / max)"

    def sync_free_trainer(self, precision: str) -> tuple[bool, float, str]:
        steps, log_every = 8, 4
        losses = trainer_losses(self, precision, steps, log_every, sync_mode=self.device.type == "cuda")
        mode = "no sync raised" if self.device.type == "cuda" else "dry run: no CUDA sync checking"
        return (
            len(losses) == steps // log_every,
            steps - len(losses),
            f"NanoTrainer's quiet steps, {precision} ({mode})",
        )

    def flash(self, documents: bool) -> tuple[bool, float, str]:
        if self.device.type != "cuda" or not flash_attn_available():
            raise Skip(
                "flash-attn is not installed" if self.device.type == "cuda" else "flash-attn needs CUDA"
            )
        losses = {}
        for impl in ("sdpa", "flash_attention_2"):
            model = self.model(attn_implementation=impl)
            with self.autocast(True):
                loss = model(self.ids, labels=self.ids, document_ids=self.docs if documents else None)
            loss.backward()
            losses[impl] = float(loss)
        diff = abs(losses["sdpa"] - losses["flash_attention_2"])
        return (
            diff < 2e-2,
            diff,
            f"|loss flash - sdpa|, bf16 ({'varlen, packed documents' if documents else 'dense'})",
        )

    def compiled(self) -> tuple[bool, float, str]:
        eager, compiled = self.model(), self.model()
        options = {"backend": "eager"} if self.dry_run else {}  # on a CPU: dynamo's path, not inductor
        compile_blocks(compiled, announce=False, **options)
        a = torch.stack(self.steps(eager, 3)).float()
        b = torch.stack(self.steps(compiled, 3)).float()
        diff = float(((a - b).abs() / a.abs()).max())
        return (
            diff < 1e-3,
            diff,
            f"max relative loss difference over 3 steps, compiled blocks vs eager ({options or 'inductor'})",
        )

    def recompute(self) -> tuple[bool, float, str]:
        reference = grads_of(self.model(), self)
        worst = 0.0
        for mode in ("full", "selective"):
            model = self.model()
            apply_activation_checkpointing(model, mode)
            got = grads_of(model, self)
            worst = max(
                worst,
                max(
                    float((g - r).abs().max() / r.abs().max().clamp_min(1e-12))
                    for g, r in zip(got, reference, strict=True)
                ),
            )
        return (
            worst < 1e-4,
            worst,
            "max gradient difference (relative to the largest), full and selective vs none",
        )

    def fused_adamw(self) -> tuple[bool, float, str]:
        model = self.model()
        twin = copy.deepcopy(model)
        try:
            fused = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        except RuntimeError as exc:
            raise Skip(f"no fused AdamW on {self.device.type}: {exc}") from exc
        plain = torch.optim.AdamW(twin.parameters(), lr=1e-3, foreach=True)
        for _ in range(3):
            model(self.ids, labels=self.ids).backward()
            for p, q in zip(model.parameters(), twin.parameters(), strict=True):
                q.grad = p.grad.clone()
            fused.step(), plain.step()
            fused.zero_grad(), plain.zero_grad()
        pairs = zip(model.parameters(), twin.parameters(), strict=True)
        diff = max(float((p.detach() - q.detach()).abs().max()) for p, q in pairs)
        return diff < 1e-5, diff, "max parameter difference after 3 steps, fused vs foreach AdamW"

    def bf16_master(self) -> tuple[bool, float, str]:
        mixed = torch.tensor(trainer_losses(self, "bf16-mixed", 8, 1))
        seen: dict[str, Any] = {}
        master = torch.tensor(trainer_losses(self, "bf16-master", 8, 1, seen=seen))
        weights, masters = seen["weights"], seen["masters"]
        if weights != {torch.bfloat16} or masters != {torch.float32}:
            return False, float("nan"), f"bf16-master trained {weights} weights with {masters} masters"
        diff = float(((mixed - master).abs() / mixed.abs()).max())
        return (
            diff < 1e-2,
            diff,
            "max relative loss difference over 8 steps, bf16-master (bf16 weights, fp32 masters) vs bf16-mixed",
        )

    def planner(self, preset: str) -> tuple[bool, float, str]:
        """The planner's one-GPU pick for `preset`, run: predicted vs measured peak and step. The
        peak compared is the tracked parts' (`max_memory_allocated` counts no caching slack); the
        allocator margin's total is shown beside `max_memory_reserved`."""
        seq_len = self.seq_len if self.dry_run else PLANNER_SEQ_LEN
        best, peak, reserved, step = planned_run(self, preset, seq_len)
        parts = best.memory_bytes
        allocated, predicted_step = parts["total"] - parts["allocator"], best.step_time_s
        memory, time_ = allocated / max(peak, 1), predicted_step / step
        within = abs(memory - 1) <= MEMORY_TOLERANCE and abs(time_ - 1) <= STEP_TOLERANCE
        measured = "peak RSS growth" if self.device.type == "cpu" else "max_memory_allocated"
        verdict = (
            "dry run: not compared"
            if self.dry_run
            else f"within {MEMORY_TOLERANCE:.0%} and {STEP_TOLERANCE:.0%}: {'yes' if within else 'no'}"
        )
        gib = 2**30
        return (
            within or self.dry_run,
            memory,
            f"predicted / measured: peak {allocated / gib:.2f} vs {peak / gib:.2f} GiB {measured}, step "
            f"{predicted_step:.3g} vs {step:.3g} s ({time_:.2f}x); with the allocator margin "
            f"{parts['total'] / gib:.2f} vs {reserved / gib:.2f} GiB reserved; {preset}, T={seq_len}, "
            f"{best.layout.overrides()} ({verdict})",
        )


def adamw(model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, fused=device.type == "cuda")


def grads_of(model: torch.nn.Module, checks: Checks) -> list[torch.Tensor]:
    model(checks.ids, labels=checks.ids, document_ids=checks.docs).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


class sync_debug:  # noqa: N801 - used as a context manager, like torch's own lower-case ones
    """`torch.cuda.set_sync_debug_mode(mode)` inside, "default" after; None: nothing (a CPU)."""

    def __init__(self, mode: str | None) -> None:
        self.mode = mode

    def __enter__(self) -> None:
        if self.mode is not None:
            torch.cuda.set_sync_debug_mode(self.mode)

    def __exit__(self, *exc: object) -> None:
        if self.mode is not None:
            torch.cuda.set_sync_debug_mode("default")


def trainer_losses(
    checks: Checks,
    precision: str,
    steps: int,
    log_every: int,
    sync_mode: bool = False,
    seen: dict[str, Any] | None = None,
) -> list[float]:
    """`steps` of NanoTrainer on the tiny model; the loss of each logging step. With `sync_mode`
    a CUDA sync on any other step raises (the trainer's promise: tests/test_sync_free.py). `seen`
    gets the dtypes the model's weights and the strategy's master weights had while training."""
    try:
        from nanolight import Callback, NanoModule, NanoTrainer  # the trainer's modules load here
        from nanolight.strategies import SingleDeviceStrategy
    except ImportError as exc:
        raise Skip(f"the trainer's dependencies are not installed ({exc})") from exc

    class LM(NanoModule):
        def configure_model(self) -> None:
            if not hasattr(self, "model"):
                self.model = checks.model()

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss = self.model(batch, labels=batch)
            self.log("train/loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return adamw(self.model, checks.device)

    class Watch(Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            if sync_mode:
                quiet = (trainer.global_step + 1) % log_every != 0
                torch.cuda.set_sync_debug_mode("error" if quiet else "default")

        def on_train_batch_end(
            self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            if trainer.global_step % log_every == 0:  # a logging step: reading values is allowed
                with sync_debug("default" if sync_mode else None):
                    self.losses.append(float(trainer.callback_metrics["train/loss"]))
            if seen is not None:
                seen["weights"] = {p.dtype for p in module.parameters()}
                masters = trainer.optimizers  # bf16-master: ZeroOptimizers holding the fp32 masters
                seen["masters"] = {m.dtype for opt in masters for m in opt.master}

    watch = Watch()
    trainer = NanoTrainer(
        strategy=SingleDeviceStrategy(checks.device), precision=precision, max_steps=steps, seed=0,
        log_every_n_steps=log_every, gradient_clip_val=1.0, logger=False, callbacks=[watch],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with sync_debug("default" if sync_mode else None):  # and back to default whatever happens
        trainer.fit(
            LM(),
            train_dataloaders=torch.utils.data.DataLoader(checks.ids.cpu().repeat(steps, 1), batch_size=2),
        )
    return watch.losses


PLANNER_SEQ_LEN = 2048  # tokens per sequence for the planner's check on a GPU
PLANNER_SEQUENCES = 16  # the global batch, in sequences: the planner picks its micro-batch split
MEMORY_TOLERANCE, STEP_TOLERANCE = 0.10, 0.20  # issue 22: peak within 10%, step within 20%


def planned_run(checks: Checks, preset: str, seq_len: int) -> tuple[Any, int, int, float]:
    """The planner's best one-device layout for `preset` at `seq_len`, trained for a few steps in
    NanoTrainer: the prediction, the measured peak bytes (and reserved, on a GPU) and the median
    step seconds."""
    try:
        from nanolight import NanoModule, NanoTrainer
        from nanolight.planner.hardware import at_hand, hardware, table_name
        from nanolight.planner.memory import Workload
        from nanolight.planner.search import plan
        from nanolight.pretrain.auto import PredictionCheck
        from nanolight.strategies import SingleDeviceStrategy
    except ImportError as exc:
        raise Skip(f"the trainer's dependencies are not installed ({exc})") from exc
    device = checks.device
    if device.type == "cuda":
        name = table_name(torch.cuda.get_device_name(device))
        if name is None:
            raise Skip(f"the planner has no figures for {torch.cuda.get_device_name(device)}")
        hw = at_hand(hardware(name), device)  # the table's figures, the host's cost per block measured
    else:
        hw = hardware("cpu")  # this machine, measured: the dry run
    config = {**PRESETS[preset]}
    work = Workload(LlamaConfig(**config), seq_len, device.type)
    best = plan(work, 1, PLANNER_SEQUENCES * seq_len, hw)[0]
    if not best.fits:
        raise RuntimeError(f"the planner finds no layout of {preset} that fits one {hw.name}")
    layout = best.layout
    steps, log_every = (4, 2) if checks.dry_run else (20, 5)  # the step's median: of 2 or 4 intervals

    class LM(NanoModule):
        def configure_model(self) -> None:
            if not hasattr(self, "model"):
                self.model = checks.model(**config)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.model(batch, labels=batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return adamw(self.model, device)

    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, config["vocab_size"], (steps * PLANNER_SEQUENCES, seq_len), generator=g)
    check = PredictionCheck(best)
    trainer = NanoTrainer(
        strategy=SingleDeviceStrategy(device, activation_checkpointing=layout.activation_checkpointing),
        precision=layout.precision, max_steps=steps, seed=0, log_every_n_steps=log_every,
        accumulate_grad_batches=layout.accumulate_grad_batches, logger=False, callbacks=[check],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(LM(), train_dataloaders=torch.utils.data.DataLoader(rows, batch_size=layout.micro_batch_size))
    peak, step = check.measured or (0, None)
    if step is None:
        raise RuntimeError(f"the run of {steps} steps timed no logging interval")
    reserved = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else 0  # reset at setup
    return best, peak, reserved, step


BENCH_START_UP = 45.0  # seconds: the interpreter, CUDA and transformers' import before the first run
HEADLINE_SHARE = 0.55  # of the budget: the headline's; the checks run in the rest
HEADLINE_PRESETS = ("smollm-1.7b", "smollm-360m")  # the first: the MFU target's model


def run_bench(checks: Checks, left: float) -> None:
    """`scripts/bench_gpu.py --headline` in `left` seconds: its time limit leaves room for its
    start-up; past them it is killed (a FAIL: the run overran)."""
    limit = max(0.0, left - BENCH_START_UP)
    presets = [arg for preset in HEADLINE_PRESETS for arg in ("--preset", preset)]
    bench = [sys.executable, str(REPO / "scripts" / "bench_gpu.py"), "--headline", "--compile", "on", *presets,
             "--time-limit", f"{limit:.0f}"]  # fmt: skip
    print(f"$ {' '.join(bench)}", flush=True)
    start = time.perf_counter()
    try:
        code = subprocess.run(bench, cwd=REPO, timeout=max(1.0, left)).returncode
        what = "exit status"
    except subprocess.TimeoutExpired:
        code, what = -1, f"killed: past the budget ({left:.0f} s were left)"
    if code:
        checks.failed.append("bench_gpu")
    print(
        f"{'FAIL' if code else 'PASS'}  {'bench_gpu.py':<26} {code:>11}  {what} ({time.perf_counter() - start:.0f} s)",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-dry-run", action="store_true", help="the CPU-capable checks, tiny, no benchmark")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per row (default: 1024 on CUDA, 32 dry)")
    p.add_argument(
        "--budget", type=float, default=450.0, help="seconds for the whole run, benchmark included"
    )
    p.add_argument("--no-bench", action="store_true", help="the checks only, no headline")
    args = p.parse_args(argv)
    start = time.perf_counter()
    if not args.cpu_dry_run and not torch.cuda.is_available():
        print(NO_CUDA.format(version=torch.__version__, cuda=torch.version.cuda or "none"), file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.cpu_dry_run else "cuda")
    checks = Checks(device, args.seq_len or (32 if args.cpu_dry_run else 1024), args.cpu_dry_run)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)"
    print(f"gpu_check on {name}, torch {torch.__version__}, T={checks.seq_len}", flush=True)
    if not (args.cpu_dry_run or args.no_bench):
        run_bench(checks, HEADLINE_SHARE * args.budget - (time.perf_counter() - start))
    checks.run("sync-free model step", checks.sync_free_model)
    checks.run("sync-free trainer steps", lambda: checks.sync_free_trainer("bf16-mixed"))
    checks.run("sync-free trainer master", lambda: checks.sync_free_trainer("bf16-master"))
    checks.run("flash-attn dense", lambda: checks.flash(documents=False))
    checks.run("flash-attn varlen", lambda: checks.flash(documents=True))
    checks.run("ring attention kernel", checks.ring_block_kernel)
    checks.run("compile", checks.compiled)
    checks.run("activation checkpointing", checks.recompute)
    checks.run("fused AdamW", checks.fused_adamw)
    checks.run("bf16-master vs bf16-mixed", checks.bf16_master)
    for preset in ("smollm-tiny",) if args.cpu_dry_run else ("smollm-135m", "smollm-360m"):
        checks.run(f"planner {preset}", lambda preset=preset: checks.planner(preset))
    verdict = (
        f"{len(checks.failed)} failed: {', '.join(checks.failed)}" if checks.failed else "every check passed"
    )
    print(f"gpu_check: {verdict}", flush=True)
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
