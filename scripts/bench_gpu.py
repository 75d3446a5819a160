"""Training throughput on one GPU: nanolight's model (bf16-master) vs transformers' LlamaForCausalLM (bf16-mixed).

    python scripts/bench_gpu.py                          # smollm-1.7b and smollm-360m, T=2048 (~7 min, H200)
    python scripts/bench_gpu.py --device cpu --preset smollm-tiny --seq-len 64 --micro-batch 2 \\
        --steps 2 --warmup 1 --compile off               # the same code path on a CPU, in seconds

One process, synthetic tokens, the recipe's model and optimizer (AdamW with the recipe's
hyperparameters and decay groups, fused on CUDA / foreach on CPU; clipping at 1.0), no host
synchronisation inside the timed steps. Each side runs its best usual setting: nanolight the
recipe's GPU default ``--precision bf16-master`` -- bf16 weights and activations, fp32 masters
and AdamW state, fp32 gradient accumulation -- through the very objects `SingleDeviceStrategy`
builds for it (`precision.py`, `parallel/zero.py`'s one-shard `ZeroOptimizer`, its fp32 gradient
buckets; the strategy's backward, clipping on the fp32 gradients, step and zero_grad);
transformers ``--peer-precision bf16-mixed`` (fp32 weights, ``torch.autocast``), as Lightning and
HF's Trainer run it. ``bf16-mixed`` and ``32-true`` for nanolight are the same plain loop as the
peer's. Every row prints its precision. nanolight runs with
compile off/on (each decoder block, `parallel/blocks.py`) x activation checkpointing
none/selective/full (`parallel/blocks.py`); transformers runs with SDPA (flash-attn when
installed, for both) eager and with each decoder layer compiled -- the same per-block compile.
Both models start from the same weights (nanolight's init, converted), and their first losses
are printed side by side (equal at the same precision; within bf16 rounding across precisions).

The micro-batch is the largest power of two up to --micro-batch at which transformers eager
(full logits, nothing recomputed: the most memory) fits; every run of a model uses it. Printed
per run: tokens/s, MFU (`models/llama_config.py`: 6N + 12 L H Q T per token, over the dense bf16
peak in `planner/hardware.py`'s table: 989 TFLOP/s for H100/H200 SXM, 756 for H100 PCIe, 835 for
NVL; or --peak-tflops), peak memory, step time; then nanolight/transformers ratios on the same
shapes. Imports only torch, transformers, safetensors and nanolight's model, parallel, planner and
strategy modules (no hydra, omegaconf, wandb, datasets or lightning-utilities: a
test runs it where they are missing): a bare GPU box runs it.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a source checkout, not installed
from nanolight.models import LlamaConfig, LlamaForCausalLM, flash_attn_available, flops_per_token  # noqa: E402
from nanolight.models.hf_adapter import nanolight_to_hf_state_dict  # noqa: E402
from nanolight.parallel.blocks import apply_activation_checkpointing, compile_blocks  # noqa: E402
from nanolight.planner.hardware import HARDWARE, table_name  # noqa: E402
from nanolight.precision import Precision  # noqa: E402
from nanolight.strategies.base import SingleDeviceStrategy  # noqa: E402


def peak_bf16(device_name: str) -> float | None:
    """The dense bf16 peak of the GPU called `device_name` (the planner's table, which
    `ThroughputMonitor` reads too); None when unknown (pass --peak-tflops)."""
    name = table_name(device_name)
    return None if name is None else HARDWARE[name].bf16_flops


DEFAULT_MICRO_BATCH = {"smollm-1.7b": 8, "smollm-360m": 16}
# the recipe's optimizer (nanolight/pretrain/config.py OptimConfig and module.py; a test checks they agree)
LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 4e-3, (0.9, 0.95), 1e-8, 0.1, 1.0


@dataclass
class Result:
    model: str
    impl: str
    compiled: bool
    recompute: str
    precision: str
    micro_batch: int
    tokens_s: float | None = None
    mfu: float | None = None
    peak_gib: float | None = None
    step_ms: float | None = None
    first_loss: float | None = None
    status: str = "ok"


def optimizer(model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    kernel = {"fused": True} if device.type == "cuda" else {"foreach": True}
    groups = [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, **kernel)


def nanolight_model(config: LlamaConfig, device: torch.device) -> LlamaForCausalLM:
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(config).train()


def transformers_model(config: LlamaConfig, device: torch.device) -> torch.nn.Module:
    import transformers

    hf_config = transformers.LlamaConfig(**config.to_hf_dict(), use_cache=False)
    hf_config._attn_implementation = config.attn_implementation
    weights = nanolight_to_hf_state_dict(config, nanolight_model(config, device).state_dict())
    with torch.device(device):
        model = transformers.LlamaForCausalLM(hf_config)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model.train()


def build(impl: str, config: LlamaConfig, device: torch.device, compiled: bool, recompute: str):
    if impl == "transformers":
        model = transformers_model(config, device)
        if compiled:
            for layer in model.model.layers:  # per decoder layer, as nanolight compiles its blocks
                layer.compile()
        return model, lambda ids: model(input_ids=ids, labels=ids).loss
    model = nanolight_model(config, device)
    apply_activation_checkpointing(model, recompute)
    if compiled:
        compile_blocks(model)
    return model, lambda ids: model(ids, labels=ids)


class TrainStep:
    """One optimizer step of `model` (forward, backward, clipping at `CLIP`, AdamW, zero_grad) at
    `precision`. ``bf16-master``: a `SingleDeviceStrategy` sets the model and its optimizer up as
    it does for the trainer (fp32 masters in a one-shard `ZeroOptimizer`, fused AdamW on them on
    CUDA, fp32 gradient buckets, then the weights cast to bf16) and runs the step's backward,
    clipping (the fp32 gradients), optimizer step and zero_grad. Otherwise the plain loop, under
    the precision's autocast (``bf16-mixed``) or none (``32-true``)."""

    def __init__(self, model: torch.nn.Module, loss_of, precision: str, device: torch.device) -> None:
        self.loss_of = loss_of
        self.autocast = Precision(precision).autocast(device)
        self.optimizer = optimizer(model, device)
        self.strategy: SingleDeviceStrategy | None = None
        if Precision(precision).master_weights:
            self.strategy = SingleDeviceStrategy(device, precision=precision)
            self.strategy.setup_module(model)
            (self.optimizer,) = self.strategy.setup_optimizers([self.optimizer])
        self.params = list(model.parameters())

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        with self.autocast:
            loss = self.loss_of(ids)
        if self.strategy is not None:
            self.strategy.backward(loss)
            self.strategy.finish_backward()
            self.strategy.clip_gradients(CLIP)
            self.strategy.optimizer_step(self.optimizer)
            self.strategy.zero_grad(self.optimizer)
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.params, CLIP, foreach=True)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args: argparse.Namespace, r: Result, config: LlamaConfig, device: torch.device) -> Result:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step = TrainStep(*build(r.impl, config, device, r.compiled, r.recompute), r.precision, device)
    g = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (r.micro_batch, args.seq_len), device=device, generator=g)
    losses, times = [], []
    for i in range(args.warmup + args.steps):
        sync(device)
        t0 = time.perf_counter()
        losses.append(step(ids))
        sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    r.step_ms, r.tokens_s = 1e3 * median, r.micro_batch * args.seq_len / median
    r.first_loss = float(losses[0])
    if args.peak is not None:
        r.mfu = flops_per_token(config, args.seq_len) * r.tokens_s / args.peak
    if device.type == "cuda":
        r.peak_gib = torch.cuda.max_memory_allocated(device) / 2**30
    return r


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err)


def plan(args: argparse.Namespace) -> list[tuple[str, bool, str, str]]:
    """(impl, compiled, recompute, precision) in the order they run: the peers first, compiled
    before eager. `--headline`: nanolight first (its figures stand whatever the time limit cuts),
    compiled ("both": on), nothing recomputed -- at its own precision, then at the peer's, then the
    peer: the ratio compares one precision."""
    compiles = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    if args.headline:
        compiled = compiles[-1]
        precisions = dict.fromkeys([args.precision, args.peer_precision])
        runs = [("nanolight", compiled, "none", p) for p in precisions]
        return [*runs, ("transformers", compiled, "none", args.peer_precision)]
    runs = [("transformers", c, "none", args.peer_precision) for c in compiles]
    runs += [
        ("nanolight", c, ac, args.precision) for c in sorted(compiles, reverse=True) for ac in args.recompute
    ]
    return runs


@dataclass
class TimeLimit:
    """`--time-limit` as a bound on the whole benchmark, not only on when the last run starts: a
    run starts only if the longest run so far (model build, compilation and steps) would still
    end in time (`scripts/gpu_check.py` fits the benchmark into its budget this way)."""

    deadline: float
    longest: float = 0.0

    def allows_another(self) -> bool:
        return time.perf_counter() + self.longest <= self.deadline

    def record(self, seconds: float) -> None:
        self.longest = max(self.longest, seconds)


def bench_model(
    args: argparse.Namespace, preset: str, device: torch.device, limit: TimeLimit
) -> list[Result]:
    config = LlamaConfig.preset(preset, attn_implementation=args.attn)
    mb = args.micro_batch or DEFAULT_MICRO_BATCH.get(preset, 2)
    results: list[Result] = []
    for impl, compiled, recompute, precision in plan(args):
        r = Result(preset, impl, compiled, recompute, precision, mb)
        started = time.perf_counter()
        if not limit.allows_another():
            r.status = "skipped (time limit)"
        else:
            while True:
                oom = False
                try:
                    r = run(args, r, config, device)
                except RuntimeError as err:
                    if not is_oom(err):
                        raise
                    oom = True  # handled below, once the exception (and its frames' tensors) is gone
                release(device)
                if not oom:
                    break
                if results or r.micro_batch == 1:  # the first run of a model fixes its micro-batch
                    r.status = "out of memory"
                    break
                r.micro_batch //= 2
                mb = r.micro_batch
            limit.record(time.perf_counter() - started)
        results.append(r)
        print(row(r), flush=True)
    return results


def row(r: Result) -> str:
    def f(v, spec):
        return format(v, spec) if v is not None else "-"

    return (
        f"{r.model:<12} {r.impl:<13} {'on' if r.compiled else 'off':<7} {r.recompute:<9} {r.precision:<11} "
        f"{r.micro_batch:>3} "
        f"{f(r.tokens_s, ',.0f'):>10} {f(r.mfu and 100 * r.mfu, '.1f'):>6} {f(r.peak_gib, '.1f'):>7} "
        f"{f(r.step_ms, '.0f'):>8} {f(r.first_loss, '.4f'):>8}  {r.status}"
    )


def ratios(results: list[Result]) -> None:
    ok = [r for r in results if r.tokens_s]
    for preset in dict.fromkeys(r.model for r in ok):
        mine = [r for r in ok if r.model == preset]
        peers = {r.compiled: r for r in mine if r.impl == "transformers"}
        ours = [r for r in mine if r.impl == "nanolight"]
        for compiled, peer in peers.items():
            alike = [r for r in ours if r.compiled == compiled and r.recompute == "none"]
            same = next((r for r in alike if r.precision == peer.precision), alike[0] if alike else None)
            if same:
                print(f"{preset}: nanolight/transformers, compile {'on' if compiled else 'off'}, "
                      f"nothing recomputed ({same.precision} vs {peer.precision}): "
                      f"{same.tokens_s / peer.tokens_s:.3f}")  # fmt: skip
        if ours:
            best = max(ours, key=lambda r: r.tokens_s)
            mfu = f", MFU {100 * best.mfu:.1f}%" if best.mfu else ""
            print(f"{preset}: best nanolight ({best.precision}): compile {'on' if best.compiled else 'off'}, "
                  f"recompute {best.recompute}: {best.tokens_s:,.0f} tokens/s{mfu}")  # fmt: skip


def main(argv: list[str] | None = None) -> list[Result]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", action="append", help="repeatable (default: smollm-1.7b, smollm-360m)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=None, help="upper bound (default per preset)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    p.add_argument("--compile", choices=["off", "on", "both"], default="both")
    p.add_argument("--recompute", default="none,selective,full", help="activation checkpointing modes")
    p.add_argument("--attn", choices=["auto", "sdpa", "flash_attention_2"], default="auto")
    p.add_argument("--precision", choices=["bf16-master", "bf16-mixed", "32-true"], default="bf16-master",
                   help="nanolight's rows")  # fmt: skip
    p.add_argument("--peer-precision", choices=["bf16-mixed", "32-true"], default="bf16-mixed",
                   help="transformers' rows (autocast or fp32)")  # fmt: skip
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak (default: by GPU name)")
    p.add_argument(
        "--time-limit",
        type=float,
        default=450.0,
        help="seconds for the whole benchmark: a run that would end later is skipped",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--headline", action="store_true",
                   help="nanolight first, then transformers at the same precision; compiled, nothing recomputed")  # fmt: skip
    args = p.parse_args(argv)
    device = torch.device(args.device)
    args.recompute = args.recompute.split(",")
    presets = args.preset or ["smollm-1.7b", "smollm-360m"]
    if args.attn == "auto":
        args.attn = "flash_attention_2" if device.type == "cuda" and flash_attn_available() else "sdpa"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    args.peak = 1e12 * args.peak_tflops if args.peak_tflops else peak_bf16(name)
    print(f"{name}, torch {torch.__version__}, nanolight {args.precision}, transformers {args.peer_precision}, "
          f"attn={args.attn}, T={args.seq_len}, "
          f"{args.steps} timed steps (median), peak {args.peak / 1e12 if args.peak else '-'} TFLOP/s")  # fmt: skip
    print(f"{'model':<12} {'impl':<13} {'compile':<7} {'recompute':<9} {'precision':<11} {'mb':>3} {'tokens/s':>10} "
          f"{'MFU%':>6} {'peakGiB':>7} {'step ms':>8} {'loss0':>8}")  # fmt: skip
    limit = TimeLimit(time.perf_counter() + args.time_limit)
    results = [r for preset in presets for r in bench_model(args, preset, device, limit)]
    ratios(results)
    return results


if __name__ == "__main__":
    main()
