"""What a host-side agreement costs per rank: a gloo group over the whole world (what nanolight used
under NCCL before) against the rendezvous store (`parallel/agreement.py`), at N local processes.

    python scripts/bench_agreement.py --ranks 16 --rounds 50

Printed by rank 0 (the slowest rank's figure where it matters): the world's set-up, the
ParallelContext's set-up, the extra gloo group's set-up and the sockets it opens per rank, and
one agreement's latency (start, then wait) both ways -- median over `--rounds`.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a source checkout, not installed
from nanolight.parallel import ParallelContext  # noqa: E402


def _link(fd: Path) -> str:
    try:
        return os.readlink(fd)
    except OSError:  # closed meanwhile (the listing's own fd)
        return ""


def sockets() -> int:
    """This process's open sockets (Linux: /proc/self/fd)."""
    fds = Path("/proc/self/fd")
    return sum(1 for fd in fds.iterdir() if _link(fd).startswith("socket:")) if fds.exists() else -1


def timed(fn):  # noqa: ANN001, ANN201 - any callable
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def worker(rank: int, world: int, port: int, rounds: int, results: mp.Queue) -> None:
    torch.set_num_threads(1)
    _, t_world = timed(lambda: dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=300)
    ))  # fmt: skip
    dist.barrier()
    ctx, t_ctx = timed(lambda: ParallelContext(dp=world, timeout=timedelta(seconds=300)))
    dist.barrier()
    before = sockets()
    world_group, t_group = timed(lambda: dist.new_group(backend="gloo", timeout=timedelta(seconds=300)))
    store_s, gloo_s = [], []
    for i in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        ctx.start_max(i % 2).wait()
        store_s.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        box = torch.tensor([i % 2])  # what the old PendingMax did: all-reduce a host int over the world
        dist.all_reduce(box, op=dist.ReduceOp.MAX, group=world_group, async_op=True).wait()
        gloo_s.append(time.perf_counter() - start)
    extra_sockets = sockets() - before  # gloo may connect its pairs at the first collective
    results.put(
        (rank, t_world, t_ctx, t_group, extra_sockets, statistics.median(store_s), statistics.median(gloo_s))
    )
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=16)
    p.add_argument("--rounds", type=int, default=50)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(r, args.ranks, port, args.rounds, results))
        for r in range(args.ranks)
    ]
    for proc in procs:
        proc.start()
    rows = [results.get(timeout=600) for _ in procs]
    for proc in procs:
        proc.join()
    slowest = [max(row[i] for row in rows) for i in range(1, 7)]
    print(f"{args.ranks} ranks (gloo, one host), slowest rank's figure:")
    print(f"  init_process_group                     {slowest[0]:8.3f} s")
    print(f"  ParallelContext (store agreements)     {slowest[1]:8.3f} s")
    print(f"  + a gloo group over the world (before) {slowest[2]:8.3f} s, {slowest[3]} sockets per rank")
    print(f"  one agreement, store (now)             {1e3 * slowest[4]:8.2f} ms (median of {args.rounds})")
    print(f"  one agreement, world gloo all-reduce   {1e3 * slowest[5]:8.2f} ms (median of {args.rounds})")


if __name__ == "__main__":
    main()
