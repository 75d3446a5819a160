"""Data-parallel step time: nanolight's bucketed reducer (and ZeRO-1) vs PyTorch DDP, one run.

    python scripts/bench_dp.py                       # dp=2 on gloo (CPU), a ~6M-parameter Llama
    python scripts/bench_dp.py --hidden 512 --layers 8 --bucket-mb 8 --steps 20

Every variant trains a copy of the same model on the same per-rank batches with AdamW:
``nanolight-dp`` (`GradReducer`, zero_stage 0), ``nanolight-zero1`` (`ZeroOptimizer`) and
``torch-ddp`` (``DistributedDataParallel``, same bucket size). A step is forward + backward (+
waiting for the reduction) + optimizer step; the median over the measured steps is printed
together with the optimizer-state bytes each rank holds with and without ZeRO-1.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from nanolight.models import LlamaConfig, LlamaForCausalLM
from nanolight.parallel.data_parallel import GradReducer
from nanolight.parallel.zero import ZeroOptimizer


def build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    return model


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of per-element optimizer state (AdamW's two moments) held by this rank."""
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if v.dim() > 0)


def time_steps(step_fn, args: argparse.Namespace) -> float:  # noqa: ANN001 - a closure
    times = []
    for i in range(args.warmup + args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        step_fn(i)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def worker(rank: int, world: int, port: int, args: argparse.Namespace, results: dict) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(minutes=5),
    )
    base = build_model(args)
    g = torch.Generator().manual_seed(1 + rank)
    data = torch.randint(0, args.vocab, (args.warmup + args.steps, args.batch, args.seq_len), generator=g)
    bucket = int(args.bucket_mb * 2**20)
    out = {}

    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    reducer = GradReducer([list(model.parameters())], dist.group.WORLD, bucket_bytes=bucket)

    def ours(i: int) -> None:
        reducer.zero_grad()
        model(data[i], labels=data[i]).backward()  # buckets go out from the backward hooks
        reducer.finish()
        opt.step()

    out["nanolight-dp"] = time_steps(ours, args)
    out["adamw_state_bytes"] = state_bytes(opt)
    reducer.remove()

    model = copy.deepcopy(base)
    zero = ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-4), dist.group.WORLD, bucket_bytes=bucket
    )

    def zero1(i: int) -> None:
        zero.zero_grad()
        model(data[i], labels=data[i]).backward()
        zero.reducer.finish()
        zero.step()  # updates this rank's shard, all-gathers the weights

    out["nanolight-zero1"] = time_steps(zero1, args)
    out["zero1_state_bytes"] = zero.state_bytes(include_master=False)
    out["zero1_master_bytes"] = zero.state_bytes() - out["zero1_state_bytes"]
    zero.reducer.remove()

    model = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=args.bucket_mb)
    ddp_opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def ddp(i: int) -> None:
        ddp_opt.zero_grad(set_to_none=True)
        model(data[i], labels=data[i]).backward()  # DDP's reducer: all-reduce per bucket, waited here
        ddp_opt.step()

    out["torch-ddp"] = time_steps(ddp, args)
    out["params"] = sum(p.numel() for p in base.parameters())
    results[rank] = out
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--bucket-mb", type=float, default=4.0)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    args = parser.parse_args()

    from torch.distributed.elastic.utils.distributed import get_free_port

    port = get_free_port()
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(worker, args=(args.dp, port, args, results), nprocs=args.dp, join=True)
        res = dict(results[0])
    print(
        f"dp={args.dp} gloo, Llama hidden={args.hidden} layers={args.layers} vocab={args.vocab} "
        f"({res['params'] / 1e6:.1f}M params), batch {args.batch}x{args.seq_len} per rank, "
        f"bucket {args.bucket_mb} MB, median of {args.steps} steps"
    )
    ddp = res["torch-ddp"]
    for name in ("nanolight-dp", "nanolight-zero1", "torch-ddp"):
        print(f"  {name:16s} {res[name] * 1e3:8.1f} ms/step   ({res[name] / ddp:.2f}x DDP)")
    mib = 2**20
    print("optimizer state per rank (AdamW exp_avg + exp_avg_sq):")
    print(f"  without ZeRO     {res['adamw_state_bytes'] / mib:8.2f} MiB")
    print(
        f"  ZeRO-1           {res['zero1_state_bytes'] / mib:8.2f} MiB"
        f"   (+ {res['zero1_master_bytes'] / mib:.2f} MiB fp32 master shard)"
    )


if __name__ == "__main__":
    main()
