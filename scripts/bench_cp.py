"""Benchmark context parallelism: what one rank holds, and how long a step takes, at cp = 1, 2, ...

The same Llama model and the same long sequences, run whole on one process (cp = 1, the peer:
what every rank of a layout without cp holds) and split over cp ranks by nanolight's ring
attention (each rank its zigzag share of every sequence, `parallel/ring_attention.py`), in one
gloo run on CPU (one thread per rank). The layouts alternate round by round, so machine noise
hits all alike; medians are reported.

    python scripts/bench_cp.py --seq-len 4096 --cp 1 2 --rounds 3
    python scripts/bench_cp.py --seq-len 8192 --cp 1 2 4 --layers 2   # cp 4 needs >= 4 free cores

Reported per cp: the activations a rank saves for its backward (bytes of distinct storages held
by autograd's saved tensors, measured with `saved_tensors_hooks`, the ring's K/V blocks in
flight not counted), the ratio to cp = 1, and the step time (forward + backward, max over ranks,
median over the timed steps) with its ratio. Gradients only: no optimizer step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanolight.models import LlamaConfig, LlamaForCausalLM  # noqa: E402
from nanolight.models.llama import shift_labels  # noqa: E402
from nanolight.parallel.ring_attention import RingAttention, zigzag_shard  # noqa: E402


class SavedBytes:
    """The bytes of distinct storages autograd holds for the backward (what a rank must keep)."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def run_rank(rank: int, cp: int, args: argparse.Namespace, port: int, out: dict) -> None:
    torch.set_num_threads(1)
    if cp > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=cp, timeout=timedelta(minutes=5))
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads // 2,
        max_position_embeddings=args.seq_len,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    if cp > 1:  # every rank is a cp rank here: the whole world is one ring
        model.set_attention_backend(RingAttention(dist.group.WORLD, list(range(cp))))
    ids = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(1))
    batch = {
        "input_ids": ids,
        "target_ids": shift_labels(ids),
        "position_ids": torch.arange(args.seq_len)[None],
    }
    batch = {k: zigzag_shard(v.expand(args.batch, -1), rank, cp) for k, v in batch.items()}
    times, saved = [], 0
    for step in range(args.warmup + args.steps):
        if cp > 1:
            dist.barrier()  # the ranks start each step together
        start, held = time.perf_counter(), SavedBytes()
        with torch.autograd.graph.saved_tensors_hooks(held.pack, lambda t: t):
            loss = model(
                batch["input_ids"], target_ids=batch["target_ids"], position_ids=batch["position_ids"]
            )
        loss.backward()
        model.zero_grad(set_to_none=True)
        elapsed = torch.tensor([time.perf_counter() - start])
        if cp > 1:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step is as slow as its slowest rank
        if step >= args.warmup:
            times.append(float(elapsed))
        saved = held.total
    if rank == 0:
        out["times"], out["saved"] = times, saved
    if cp > 1:
        dist.destroy_process_group()


def measure(cp: int, args: argparse.Namespace, port: int) -> dict:
    if cp == 1:
        out: dict = {}
        run_rank(0, 1, args, port, out)
        return out
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(run_rank, args=(cp, args, port, out), nprocs=cp)
        return dict(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    if any(args.seq_len % (2 * cp) for cp in args.cp):
        sys.exit(f"bench_cp: --seq-len {args.seq_len} must be divisible by 2*cp for every --cp {args.cp}")
    times: dict[int, list[float]] = {cp: [] for cp in args.cp}
    saved: dict[int, int] = {}
    for round_ in range(args.rounds):  # alternate the layouts: noise hits all alike
        for i, cp in enumerate(args.cp):
            result = measure(cp, args, 29500 + 10 * round_ + i)
            times[cp] += result["times"]
            saved[cp] = result["saved"]
    base_cp = args.cp[0]
    base_time, base_saved = statistics.median(times[base_cp]), saved[base_cp]
    print(
        f"seq_len {args.seq_len}, batch {args.batch}, {args.layers} layers, hidden {args.hidden}; "
        f"medians of {args.rounds} x {args.steps} steps"
    )
    print(f"{'cp':>3} {'saved activations/rank':>24} {'vs cp=' + str(base_cp):>9} {'step s':>8} {'vs':>6}")
    for cp in args.cp:
        t = statistics.median(times[cp])
        print(
            f"{cp:>3} {saved[cp] / 2**20:>20.1f} MiB {saved[cp] / base_saved:>9.2f} {t:>8.3f} {t / base_time:>6.2f}"
        )


if __name__ == "__main__":
    main()
