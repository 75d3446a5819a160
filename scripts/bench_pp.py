"""Benchmark nanolight's 1F1B pipeline against PyTorch's `torch.distributed.pipelining.Schedule1F1B`.

Both run the same Llama model, the same stage split (nanolight's `balanced_layer_split`), the
same micro-batches, in one gloo run on CPU (one thread per rank), one after the other:

    python scripts/bench_pp.py --pp 2 --micro-batches 8
    python scripts/bench_pp.py --pp 4 --micro-batches 8 --layers 8     # needs >= 4 free cores

Reported: the step time of each (max over ranks, median over the timed steps), their ratio,
and the bubble -- nanolight measures it directly as the time each stage spends blocked in
receives divided by the step time; for PyTorch it is estimated as 1 - (nanolight's busy time
per stage) / (PyTorch's step time), the compute being identical -- next to the ideal
(p-1)/(m+p-1). Gradients only (no optimizer step): the schedules are what is compared.
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
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanolight.models import LlamaConfig, LlamaForCausalLM  # noqa: E402
from nanolight.models.llama import causal_lm_loss  # noqa: E402
from nanolight.parallel import ParallelContext  # noqa: E402
from nanolight.parallel.init import init_replayed_, param_specs  # noqa: E402
from nanolight.parallel.pipeline import (  # noqa: E402
    FORWARD,
    PipelineSplit,
    PipelineStage,
    apply_split,
    bubble_fraction,
    plan_split,
)


def build_stage(cfg: LlamaConfig, ctx: ParallelContext, seed: int) -> tuple[LlamaForCausalLM, PipelineSplit]:
    """This rank's stage of the model, initialised like the single-device model."""
    with torch.device("meta"):
        lm = LlamaForCausalLM(cfg)
    specs = param_specs(lm)
    split = plan_split(lm, ctx.pp_size)
    apply_split(lm, split, ctx.pp_rank)
    lm.to_empty(device="cpu")
    init_replayed_(lm, specs, torch.Generator().manual_seed(seed), {})
    return lm, split


class TorchStage(nn.Module):
    """The same stage as a plain activation -> activation module, for torch's PipelineStage."""

    def __init__(self, lm: nn.Module, first: bool) -> None:
        super().__init__()
        self.lm, self.first = lm, first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            return self.lm(x)  # token ids -> (B, T, C)
        ids = torch.zeros(x.shape[:2], dtype=torch.long)  # the model reads positions from its shape
        return self.lm(ids, hidden_states=x)  # (B, T, C), or the logits (B, T, V) on the last stage


def torch_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return causal_lm_loss(logits, F.pad(labels[:, 1:], (0, 1), value=-100))


def run_schedule(stage: PipelineStage, ids: torch.Tensor) -> torch.Tensor:
    """What the trainer does with the strategy's schedule, minus the hooks."""
    m, losses = len(ids), {}
    for kind, i in stage.start_step("1f1b", m):
        if kind == FORWARD:
            with stage.micro_batch(i):
                losses[i] = stage.model(ids[i], labels=ids[i])
        else:
            stage.backward(i, losses[i] / m)
            losses[i] = losses[i].detach()
    stage.finish()
    return torch.stack([losses[i] for i in range(m)]).mean()


def _timed(fn, steps: int, warmup: int) -> list[float]:
    times = []
    for s in range(warmup + steps):
        dist.barrier()  # every rank starts the step together
        start = time.perf_counter()
        fn()
        t = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # ranks agree on the slowest rank's step time
        if s >= warmup:
            times.append(t.item())
    return times


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(minutes=5),
    )
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
    ids = torch.randint(
        0,
        cfg.vocab_size,
        (args.micro_batches, args.batch, args.seq),
        generator=torch.Generator().manual_seed(0),
    )

    # ---- nanolight 1F1B
    ours, split = build_stage(cfg, ctx, seed=1)
    pipe = PipelineStage.of(ours, split, ctx)
    losses: list[float] = []

    def ours_step() -> None:
        ours.zero_grad(set_to_none=True)
        losses.append(run_schedule(pipe, ids).item())

    # ---- torch.distributed.pipelining Schedule1F1B on an identical copy
    from torch.distributed.pipelining import PipelineStage as TorchPipelineStage
    from torch.distributed.pipelining import Schedule1F1B

    theirs, _ = build_stage(cfg, ctx, seed=1)
    first, last = ctx.is_first_stage, ctx.is_last_stage
    stage = TorchPipelineStage(TorchStage(theirs, first), ctx.pp_rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=args.micro_batches, loss_fn=torch_loss)
    full = ids.reshape(-1, args.seq)  # torch splits the batch into micro-batches itself
    torch_losses: list[float] = []

    def torch_step() -> None:
        theirs.zero_grad(set_to_none=True)
        if first:
            schedule.step(full)
        elif last:
            step_losses: list[torch.Tensor] = []
            schedule.step(target=full, losses=step_losses, return_outputs=False)
            torch_losses.append(torch.stack(step_losses).mean().item())
        else:
            schedule.step()

    # Warm up both, then alternate their timed steps so machine noise hits both alike.
    _timed(ours_step, 0, args.warmup)  # warm-up: metadata handshake, allocator
    _timed(torch_step, 0, args.warmup)
    pipe.p2p.recv_wait_s = 0.0
    ours_times, torch_times = [], []
    for _ in range(args.steps):
        ours_times += _timed(ours_step, 1, 0)
        torch_times += _timed(torch_step, 1, 0)
    waits = pipe.p2p.recv_wait_s / args.steps  # this stage's idle time per step

    wait = torch.tensor([waits, statistics.median(ours_times)], dtype=torch.float64)
    gathered = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(gathered, wait)  # every stage shares its receive wait and step time
    if rank == world - 1:
        out["loss_ours"], out["loss_torch"] = losses[0], torch_losses[0]
    if rank == 0:
        out["ours"], out["torch"] = statistics.median(ours_times), statistics.median(torch_times)
        out["waits"] = [g[0].item() for g in gathered]
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()

    from socket import socket

    with socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(worker, args=(args.pp, port, args, out), nprocs=args.pp, join=True)

    p, m = args.pp, args.micro_batches
    ours, theirs, waits = out["ours"], out["torch"], out["waits"]
    busy = ours - statistics.mean(waits)
    print(
        f"pp={p} micro-batches={m} layers={args.layers} hidden={args.hidden} seq={args.seq} batch={args.batch}"
    )
    print(f"first-step loss: nanolight {out['loss_ours']:.6f}  torch {out['loss_torch']:.6f}")
    print(f"step time: nanolight 1F1B {ours * 1e3:.1f} ms   torch Schedule1F1B {theirs * 1e3:.1f} ms")
    print(f"ratio nanolight / torch: {ours / theirs:.3f}")
    print(f"ideal bubble (p-1)/(m+p-1): {bubble_fraction(m, p):.3f}")
    print(
        f"measured bubble, nanolight (recv wait / step, mean over stages): {statistics.mean(waits) / ours:.3f}"
        f"  per stage {[round(w / ours, 3) for w in waits]}"
    )
    print(f"estimated bubble, torch (1 - nanolight busy / torch step): {1 - busy / theirs:.3f}")


if __name__ == "__main__":
    main()
