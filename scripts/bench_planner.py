"""The planner's step-time ranking against measured runs on this machine (a benchmark, not a test).

    python scripts/bench_planner.py [--steps 6] [--rounds 3] [--hidden 128] [--layers 4] [--seq-len 128]

For each layout of a small matrix (one process, dp2, dp2 ZeRO-1, tp2, tp2-sp, pp2 1F1B, pp2 AFAB,
pp2 interleaved, full recompute, tp2·pp2; then full recompute under tp2 and pp2, and one sequence
per micro-batch in one process, tp2 and pp2), a short fp32 run through `NanoTrainer` on gloo CPU
ranks (one thread each) measures the optimizer-step time: the fastest step (the first left out)
of `--rounds` rounds that alternate the layouts. `nanolight.planner` predicts it with the `cpu`
hardware calibrated, and its blocks timed (`planner/probes.py`), before each
round; each prediction is its round's best (noise on a shared machine only ever adds time, on
both sides alike). While they train and while the CPU is calibrated, the ranks run at raised CPU
priority (`--priority`, root only: other jobs on a shared machine otherwise take the cores at
random, and more ranks take more of them). Reported: each layout's predicted and measured step
time, and Spearman's rank correlation between the two orders (the issue's target: >= 0.8), over
the whole matrix and over its first ten layouts (the degrees and schedules alone).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a source checkout, not installed
from torch.utils.data import DataLoader  # noqa: E402

from nanolight import Callback, NanoModule, NanoTrainer  # noqa: E402
from nanolight.models import LlamaConfig, LlamaForCausalLM  # noqa: E402
from nanolight.planner.hardware import calibrate_cpu  # noqa: E402
from nanolight.planner.layout import Layout  # noqa: E402
from nanolight.planner.memory import Workload  # noqa: E402
from nanolight.planner.probes import forget_probes  # noqa: E402
from nanolight.planner.timing import step_time  # noqa: E402
from nanolight.strategies import Parallel3DStrategy  # noqa: E402

MATRIX = {
    "1 process": Layout(),
    "1 process full-AC": Layout(activation_checkpointing="full"),
    "dp2": Layout(dp=2),
    "dp2 zero1": Layout(dp=2, zero_stage=1),
    "tp2": Layout(tp=2),
    "tp2 sp": Layout(tp=2, sequence_parallel=True),
    "pp2 1f1b": Layout(pp=2),
    "pp2 afab": Layout(pp=2, pp_schedule="afab"),
    "pp2 interleaved": Layout(pp=2, pp_schedule="interleaved_1f1b", pp_virtual=2),
    "tp2 pp2": Layout(tp=2, pp=2),
    # the choices a planner weighs besides the degrees: recompute, and how the batch is split
    # (one sequence per micro-batch: the same tokens, four times the micro-batches)
    "tp2 full-AC": Layout(tp=2, activation_checkpointing="full"),
    "pp2 full-AC": Layout(pp=2, activation_checkpointing="full"),
    "1 process mb1": Layout(micro_batch_size=1, accumulate_grad_batches=16),
    "tp2 mb1": Layout(tp=2, micro_batch_size=1, accumulate_grad_batches=16),
    "pp2 mb1": Layout(pp=2, micro_batch_size=1, accumulate_grad_batches=16),
}
ORIGINAL = list(MATRIX)[:10]  # the matrix of the earlier figures (README), reported on its own too


class Model(NanoModule):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model: LlamaForCausalLM | None = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = LlamaForCausalLM(self.config)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self.model(batch["input_ids"], labels=batch["input_ids"])

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class StepClock(Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._last: float | None = None
        self._step = 0

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step != self._step:
            self._step = trainer.global_step
            now = time.perf_counter()
            if self._last is not None:
                self.times.append(now - self._last)
            self._last = now


def _config(args: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=True,
    )


def _layout(layout: Layout, args: argparse.Namespace) -> Layout:
    """`layout` in fp32, its batch split `--micro` x `--accumulate` unless it sets its own."""
    if (layout.micro_batch_size, layout.accumulate_grad_batches) == (1, 1):
        batch = {"micro_batch_size": args.micro, "accumulate_grad_batches": args.accumulate}
        layout = dataclasses.replace(layout, **batch)
    return dataclasses.replace(layout, precision="32-true")


@contextmanager
def priority(nice: int) -> Iterator[None]:
    """Every thread of this process (gloo's too) at niceness `nice` for the block, then back; where
    that is not allowed (not root), unchanged. Threads and processes started inside inherit it."""
    threads = [int(t) for t in os.listdir("/proc/self/task")]
    before = {t: os.getpriority(os.PRIO_PROCESS, t) for t in threads}
    try:
        for t in threads:
            os.setpriority(os.PRIO_PROCESS, t, nice)
    except (PermissionError, ProcessLookupError):
        pass
    try:
        yield
    finally:
        for t, value in before.items():
            try:
                os.setpriority(os.PRIO_PROCESS, t, value)
            except (PermissionError, ProcessLookupError):
                pass


def worker(rank: int, world: int, port: int, layout: Layout, args: argparse.Namespace, out: Any) -> None:
    torch.set_num_threads(1)
    env = {
        "RANK": rank,
        "WORLD_SIZE": world,
        "LOCAL_RANK": rank,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
    }
    os.environ.update({k: str(v) for k, v in env.items()})
    url = f"tcp://127.0.0.1:{port}"
    dist.init_process_group(
        "gloo", init_method=url, rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )
    degrees = ("tp", "pp", "dp", "zero_stage", "pp_schedule", "pp_virtual", "sequence_parallel")
    strategy = Parallel3DStrategy(
        **{k: getattr(layout, k) for k in degrees}, activation_checkpointing=layout.activation_checkpointing
    )
    clock = StepClock()
    trainer = NanoTrainer(
        max_steps=args.steps,
        accumulate_grad_batches=layout.accumulate_grad_batches,
        strategy=strategy,
        seed=0,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        callbacks=[clock],
        enable_model_summary=False,
    )
    n = args.steps * layout.accumulate_grad_batches * layout.micro_batch_size * layout.dp
    ids = torch.randint(0, args.vocab, (n, args.seq_len), generator=torch.Generator().manual_seed(0))
    with priority(args.priority):
        trainer.fit(
            Model(_config(args)),
            DataLoader([{"input_ids": x} for x in ids], batch_size=layout.micro_batch_size),
        )
    if rank == 0:
        out.put(min(clock.times[1:] or clock.times))
    dist.destroy_process_group()


def measure(layout: Layout, args: argparse.Namespace, tries: int = 3) -> float:
    """The fastest step's seconds of `layout` (the first step left out); a run whose ranks could not meet (a port taken between
    picking and binding it) is started again on another port."""
    import queue

    ctx = mp.get_context("spawn")
    for _ in range(tries):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = ctx.Queue()
        procs = [
            ctx.Process(target=worker, args=(r, layout.world_size, port, layout, args, out))
            for r in range(layout.world_size)
        ]
        for p in procs:
            p.start()
        seconds = None
        while seconds is None and not any(p.exitcode not in (None, 0) for p in procs):
            try:
                seconds = out.get(timeout=2)
            except queue.Empty:
                continue
        for p in procs:
            if seconds is None:
                p.kill()
            p.join(timeout=60)
        if seconds is not None:
            return seconds
    raise RuntimeError(f"{layout} did not run in {tries} tries")


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation: Pearson's over the ranks, tied values sharing their average
    rank (the planner predicts some layouts alike, dp2 with and without ZeRO-1 here)."""

    def ranks(x: list[float]) -> list[float]:
        order = sorted(range(len(x)), key=x.__getitem__)
        r = [0.0] * len(x)
        start = 0
        while start < len(order):
            end = start
            while end + 1 < len(order) and x[order[end + 1]] == x[order[start]]:
                end += 1
            for position in range(start, end + 1):
                r[order[position]] = (start + end) / 2
            start = end + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    spread = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / spread if spread else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument(
        "--rounds", type=int, default=3, help="every layout once per round; the fastest counts"
    )
    parser.add_argument("--priority", type=int, default=-15, help="niceness while timed (root only)")
    args = parser.parse_args()
    work = Workload(_config(args), args.seq_len, "cpu")
    layouts = {name: _layout(base, args) for name, base in MATRIX.items()}
    runs: list[list[float]] = [[] for _ in layouts]
    predictions: list[list[float]] = [[] for _ in layouts]
    for r in range(args.rounds):  # rounds alternate the layouts: other jobs' load hits all alike
        with priority(args.priority):
            hw = calibrate_cpu()
            forget_probes()  # the blocks timed again, beside this round's runs
            for i, layout in enumerate(layouts.values()):
                predictions[i].append(step_time(work, layout, hw)["total"])
        print(
            f"round {r}: cpu {hw.bf16_flops / 1e9:.1f} GFLOP/s per thread ({hw.concurrency:.2f} of it on "
            f"{hw.shared_cores} busy cores), block host cost {hw.block_overhead * 1e3:.2f} ms, gloo "
            f"{hw.intra_node_bandwidth / 1e9:.2f} GB/s, busy latency {hw.latency * 1e3:.2f} ms",
            flush=True,
        )
        for i, (name, layout) in enumerate(layouts.items()):
            runs[i].append(measure(layout, args))
            print(
                f"round {r}: {name:>20}: predicted {predictions[i][-1]:7.3f} s   measured {runs[i][-1]:7.3f} s",
                flush=True,
            )
    # each figure at its best over the rounds: the load of other jobs only ever adds time, to the
    # probes and calibration as to the runs
    predicted = [min(times) for times in predictions]
    measured = [min(times) for times in runs]
    for name, p, m in zip(layouts, predicted, measured, strict=True):
        print(f"{name:>20}: predicted {p:7.3f} s   measured {m:7.3f} s")
    print(f"Spearman rank correlation over {len(MATRIX)} layouts: {spearman(predicted, measured):.2f}")
    first = [list(layouts).index(name) for name in ORIGINAL]
    print(
        f"Spearman over the first {len(ORIGINAL)} (the degrees and schedules): "
        f"{spearman([predicted[i] for i in first], [measured[i] for i in first]):.2f}"
    )


if __name__ == "__main__":
    main()
