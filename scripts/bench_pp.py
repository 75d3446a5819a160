"""Benchmark nanolight's pipeline schedules against PyTorch's `torch.distributed.pipelining`.

Four runs of the same Llama model, the same micro-batches, in one gloo run on CPU (one thread
per rank), their timed steps alternating so that machine noise hits all alike:

    nanolight 1F1B            vs  torch Schedule1F1B              (p stages: nanolight's split)
    nanolight interleaved     vs  torch ScheduleInterleaved1F1B   (p*v chunks: nanolight's split)

    python scripts/bench_pp.py --pp 2 --micro-batches 8 --virtual 2
    python scripts/bench_pp.py --pp 4 --micro-batches 8 --layers 16     # needs >= 4 free cores

Reported: each run's step time (max over ranks, median over the timed steps), the ratios, and
nanolight's bubble, measured directly -- the time each rank spends blocked in receives divided by
the step time, mean over ranks, plus the time spent completing batches for their sends (shown apart) -- next to
the ideal (p-1)/(v*m+p-1); and what each rank's stage sent per step on each stream and the most
activations it held for sends at once (`StageP2P.last_traffic`). PyTorch's bubble is estimated as 1 - (nanolight's busy time) / (its step
time), the compute being identical. Gradients only (no optimizer step): the schedules are what
is compared.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanolight.models import LlamaConfig, LlamaForCausalLM  # noqa: E402
from nanolight.models.llama import causal_lm_loss  # noqa: E402
from nanolight.parallel import ParallelContext  # noqa: E402
from nanolight.parallel.pipeline import (  # noqa: E402
    FORWARD,
    PipelineSplit,
    PipelineStage,
    apply_split,
    bubble_fraction,
    plan_split,
)
from nanolight.parallel.shard import init_replayed_, param_specs  # noqa: E402
from nanolight.planner.probes import join_local_gloo  # noqa: E402


def build(cfg: LlamaConfig, split: PipelineSplit, stage: int, seed: int) -> LlamaForCausalLM:
    """Stage `stage` of `split` (meta, then materialised), initialised like the single-device model."""
    with torch.device("meta"):
        lm = LlamaForCausalLM(cfg)
    specs = param_specs(lm)
    apply_split(lm, split, stage)
    lm.to_empty(device="cpu")
    init_replayed_(lm, specs, torch.Generator().manual_seed(seed), {})
    return lm


class TorchStage(nn.Module):
    """One chunk as a plain activation -> activation module, for torch's PipelineStage."""

    def __init__(self, lm: nn.Module, first: bool) -> None:
        super().__init__()
        self.lm, self.first = lm, first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            return self.lm(x)  # token ids -> (B, T, C)
        ids = torch.zeros(x.shape[:2], dtype=torch.long)  # the model reads positions from its shape
        return self.lm(ids, hidden_states=x)  # (B, T, C), or the logits (B, T, V) in the last chunk


def torch_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return causal_lm_loss(logits, F.pad(labels[:, 1:], (0, 1), value=-100))


def run_schedule(stage: PipelineStage, schedule: str, ids: torch.Tensor) -> torch.Tensor:
    """What the trainer does with the strategy's schedule, minus the hooks."""
    m, losses = len(ids), {}
    for kind, i in stage.run_step(schedule, m):
        if kind == FORWARD:
            losses[i] = stage.model(ids[i], labels=ids[i])
        else:
            stage.backward(losses[i] / m)
            losses[i] = losses[i].detach()
    return torch.stack([losses[i] for i in range(m)]).mean()


def _timed(fn: Callable[[], None]) -> float:
    dist.barrier()  # every rank starts the step together
    start = time.perf_counter()
    fn()
    t = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # ranks agree on the slowest rank's step time
    return t.item()


def nanolight_run(cfg: LlamaConfig, ctx: ParallelContext, schedule: str, virtual: int, ids: torch.Tensor):
    split = plan_split(_meta(cfg), ctx.pp_size, virtual=virtual)
    lm = build(cfg, split, ctx.pp_rank, seed=1)
    stage = PipelineStage.of(lm, split, ctx)
    losses: list[float] = []

    def step() -> None:
        lm.zero_grad(set_to_none=True)
        losses.append(run_schedule(stage, schedule, ids).item())

    return step, stage, losses


def torch_run(cfg: LlamaConfig, ctx: ParallelContext, virtual: int, ids: torch.Tensor):
    """torch's Schedule1F1B (v = 1) or ScheduleInterleaved1F1B on nanolight's split into p*v chunks."""
    from torch.distributed.pipelining import PipelineStage as TorchPipelineStage
    from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleaved1F1B

    p, m = ctx.pp_size, len(ids)
    chunked = dataclasses.replace(plan_split(_meta(cfg), p, virtual=virtual), virtual=1)  # p*v stages
    chunks = [c * p + ctx.pp_rank for c in range(virtual)]
    models = [build(cfg, chunked, g, seed=1) for g in chunks]
    stages = [
        TorchPipelineStage(TorchStage(lm, g == 0), g, p * virtual, torch.device("cpu"))
        for lm, g in zip(models, chunks, strict=True)
    ]
    if virtual == 1:
        schedule = Schedule1F1B(stages[0], n_microbatches=m, loss_fn=torch_loss)
    else:
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=torch_loss)
    full = ids.reshape(-1, ids.shape[-1])  # torch splits the batch into micro-batches itself
    losses: list[float] = []

    def step() -> None:
        for lm in models:
            lm.zero_grad(set_to_none=True)
        if ctx.is_first_stage:
            schedule.step(full)
        elif ctx.is_last_stage:
            step_losses: list[torch.Tensor] = []
            schedule.step(target=full, losses=step_losses, return_outputs=False)
            losses.append(torch.stack(step_losses).mean().item())
        else:
            schedule.step()

    return step, losses


def _meta(cfg: LlamaConfig) -> LlamaForCausalLM:
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: dict) -> None:
    join_local_gloo(rank, world, port)  # one thread, a gloo world of its own on this host
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 128),
        max_position_embeddings=args.seq,
    )
    ctx = ParallelContext(tp=1, pp=world, dp=1)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.micro_batches, args.batch, args.seq), generator=gen)
    ours_1, stage_1, loss_1 = nanolight_run(cfg, ctx, "1f1b", 1, ids)
    ours_v, stage_v, loss_v = nanolight_run(cfg, ctx, "interleaved_1f1b", args.virtual, ids)
    torch_1, tloss_1 = torch_run(cfg, ctx, 1, ids)
    torch_v, tloss_v = torch_run(cfg, ctx, args.virtual, ids)
    runs = {"ours_1": ours_1, "torch_1": torch_1, "ours_v": ours_v, "torch_v": torch_v}

    for _ in range(args.warmup):  # metadata handshakes, shape inference, allocator
        for fn in runs.values():
            _timed(fn)
    for stage in (stage_1, stage_v):
        stage.p2p.recv_wait_s = stage.p2p.send_wait_s = 0.0
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.steps):  # alternate: noise hits every run alike
        for name, fn in runs.items():
            times[name].append(_timed(fn))
    medians = {name: statistics.median(t) for name, t in times.items()}

    mine = []
    for stage, name in ((stage_1, "ours_1"), (stage_v, "ours_v")):
        p2p = stage.p2p
        mine += [p2p.recv_wait_s / args.steps / medians[name], p2p.send_wait_s / args.steps / medians[name]]
    for stage in (stage_1, stage_v):  # the last step's traffic: bytes sent, most held, per stream
        mine += [*stage.p2p.last_traffic.sent_bytes, *stage.p2p.last_traffic.peak_held_bytes]
    gathered = [torch.zeros(len(mine), dtype=torch.float64) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor(mine, dtype=torch.float64))  # every rank's waits and traffic
    if rank == world - 1:
        out["losses"] = [loss_1[0], loss_v[0], tloss_1[0], tloss_v[0]]
    if rank == 0:
        out["medians"] = medians
        out["waits"] = [g.tolist() for g in gathered]
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--virtual", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()

    from socket import socket

    with socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(worker, args=(args.pp, port, args, out), nprocs=args.pp, join=True)

    p, v, m = args.pp, args.virtual, args.micro_batches
    t, waits = out["medians"], out["waits"]
    print(f"pp={p} virtual={v} micro-batches={m} layers={args.layers} hidden={args.hidden} seq={args.seq} "
          f"batch={args.batch} vocab={args.vocab}, {args.steps} timed steps")  # fmt: skip
    print("first-step loss: nanolight 1F1B {:.6f}  interleaved {:.6f}  torch 1F1B {:.6f}  interleaved {:.6f}".format(
        *out["losses"]))  # fmt: skip
    print(f"step time (ms): nanolight 1F1B {t['ours_1'] * 1e3:.1f}  torch Schedule1F1B {t['torch_1'] * 1e3:.1f}  "
          f"nanolight interleaved {t['ours_v'] * 1e3:.1f}  torch ScheduleInterleaved1F1B {t['torch_v'] * 1e3:.1f}")  # fmt: skip
    print(f"speed-up nanolight 1F1B over torch 1F1B:                {t['torch_1'] / t['ours_1']:.3f}")
    print(f"speed-up nanolight interleaved over torch interleaved:  {t['torch_v'] / t['ours_v']:.3f}")
    print(f"speed-up nanolight interleaved over nanolight 1F1B:     {t['ours_1'] / t['ours_v']:.3f}")
    for col, name, vv in ((0, "1F1B", 1), (2, "interleaved", v)):
        recv = [w[col] for w in waits]
        drain = [w[col + 1] for w in waits]
        key = "ours_1" if vv == 1 else "ours_v"
        busy = t[key] * (1 - statistics.mean(recv) - statistics.mean(drain))
        torch_key = "torch_1" if vv == 1 else "torch_v"
        print(f"{name}: bubble ideal (p-1)/(v*m+p-1) {bubble_fraction(m, p, vv):.3f}; measured (receive + send "
              f"wait / step, mean over ranks) {statistics.mean(recv) + statistics.mean(drain):.3f}, receives per "
              f"rank {[round(x, 3) for x in recv]}, sends (earlier batches completed, the step's end) "
              f"{statistics.mean(drain):.3f}; torch estimated {1 - busy / t[torch_key]:.3f}")  # fmt: skip
    act = args.batch * args.seq * args.hidden * 4  # bytes of one fp32 activation
    for col, name in ((4, "1F1B"), (8, "interleaved")):
        sent = [f"{w[col] / 2**20:.2f}/{w[col + 1] / 2**20:.2f}" for w in waits]
        held = [f"{w[col + 2] / act:.0f}/{w[col + 3] / act:.0f}" for w in waits]
        print(f"{name}: MiB sent per step (forward/backward stream) per rank {sent}; most activations held "
              f"for sends at once {held}")  # fmt: skip


if __name__ == "__main__":
    main()
