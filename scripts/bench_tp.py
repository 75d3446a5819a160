"""Benchmark nanolight's tensor parallelism against PyTorch's own, on the same model and data.

    python scripts/bench_tp.py                      # tp=2 on gloo/CPU (re-launches itself x2)
    python scripts/bench_tp.py --tp 4 --hidden 512  # bigger; under torchrun on GPUs it uses NCCL

Both sides shard the same plain `LlamaForCausalLM` with the same weights (qkv/gate_up
column-wise, o/down row-wise, embedding vocab-wise, lm_head column-wise; gate_up's rows [gate | up]
each half split, which PyTorch's contiguous split gets from rows reordered once, before sharding):

* nanolight: `apply_tensor_parallel` + vocab-parallel cross-entropy (logits never gathered);
* PyTorch: `torch.distributed.tensor.parallel.parallelize_module` with ColwiseParallel /
  RowwiseParallel and `loss_parallel()` for the sharded-logits loss.

It checks that both give the same loss, prints the bytes each keeps for backward per rank (one
training forward; the head + loss apart: nanolight's runs in token chunks, keeping d hidden and
an fp32 d weight of its vocabulary slice, where `loss_parallel` keeps the sharded logits and
their softmax), then times forward+backward+AdamW steps, alternating
blocks of the two so machine-load drift hits both equally, and prints the median step times
and their ratio (nanolight / PyTorch; < 1 means nanolight is faster).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist

from nanolight.models import LlamaConfig, LlamaForCausalLM
from nanolight.models.llama import causal_lm_loss
from nanolight.parallel.launcher import ensure_processes, init_distributed
from nanolight.parallel.tensor_parallel.apply import apply_tensor_parallel
from nanolight.parallel.tensor_parallel.layers import shard_of


def build_config(args: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads // 2,
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )


def reference_model(cfg: LlamaConfig, device: torch.device) -> LlamaForCausalLM:
    model = LlamaForCausalLM(cfg)
    model.init_weights(torch.Generator().manual_seed(0))  # same full weights on every rank
    return model.to(device)


def nanolight_tp(cfg: LlamaConfig, device: torch.device) -> LlamaForCausalLM:
    model = reference_model(cfg, device)
    return apply_tensor_parallel(model, model.tp_plan, dist.group.WORLD)  # copies each rank's slice


def torch_tp(cfg: LlamaConfig, device: torch.device) -> tuple[LlamaForCausalLM, object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        loss_parallel,
        parallelize_module,
    )

    model = reference_model(cfg, device)
    tp = dist.get_world_size()
    with torch.no_grad():  # rank r's contiguous rows are then [gate_r | up_r], as nanolight's shard
        for layer in model.model.layers:
            w = layer.mlp.gate_up_proj.weight
            w.copy_(torch.cat([shard_of(w, 0, r, tp, chunks=2) for r in range(tp)]))
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),  # vocab-parallel embedding
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),  # logits stay sharded
    }
    for i in range(cfg.num_hidden_layers):
        prefix = f"model.layers.{i}."
        plan[prefix + "self_attn.qkv_proj"] = ColwiseParallel()
        plan[prefix + "self_attn.o_proj"] = RowwiseParallel()
        plan[prefix + "mlp.gate_up_proj"] = ColwiseParallel()
        plan[prefix + "mlp.down_proj"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    # the head's logits and `loss_parallel`'s loss over them (the model's own fused head + loss
    # takes plain tensors, not DTensors): the same loss, not the identical function object
    model.loss_fn = functools.partial(causal_lm_loss)
    return model, loss_parallel


def saved_bytes(model: torch.nn.Module, run: Callable[[], torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd saves during `run` (parameters left out; a DTensor
    counted by its local shard), its backward run after so the graph is freed."""
    from torch.distributed.tensor import DTensor

    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    params = {p.untyped_storage().data_ptr() for p in local}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        x = t.to_local() if isinstance(t, DTensor) else t
        x = x.wait() if hasattr(x, "wait") else x  # torch's functional collectives' result: the tensor
        storage = x.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = run()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def timed_steps(
    model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor, n: int, ctx
) -> list[float]:
    times = []
    for _ in range(n):
        dist.barrier()
        start = time.perf_counter()
        with ctx():
            loss = model(ids, labels=ids)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if ids.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=5, help="timed steps per block")
    p.add_argument("--blocks", type=int, default=4, help="alternating nanolight/PyTorch blocks")
    args = p.parse_args()

    env = ensure_processes(args.tp)  # plain python: re-launch as tp processes, exit with their status
    init_distributed(env, timeout=timedelta(minutes=5))
    device = torch.device("cuda", env.local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(max(1, (torch.get_num_threads()) // args.tp))
    cfg = build_config(args)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)

    ours = nanolight_tp(cfg, device)
    theirs, loss_parallel = torch_tp(cfg, device)
    with torch.no_grad(), loss_parallel():
        ours_loss, theirs_loss = ours(ids, labels=ids).item(), theirs(ids, labels=ids).item()
    kept = {}
    for name, model, ctx in (("nanolight", ours, nullcontext), ("pytorch", theirs, loss_parallel)):
        with ctx():  # the whole step, and the decoder alone: the rest is the head + loss's
            step = saved_bytes(model, lambda m=model: m(ids, labels=ids))
            kept[name] = (step, step - saved_bytes(model, lambda m=model: m.model(ids).sum()))
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-4)
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=1e-4)
    timed_steps(ours, opt_ours, ids, 2, nullcontext)  # warm-up
    timed_steps(theirs, opt_theirs, ids, 2, loss_parallel)
    t_ours, t_theirs = [], []
    for _ in range(args.blocks):
        t_ours += timed_steps(ours, opt_ours, ids, args.steps, nullcontext)
        t_theirs += timed_steps(theirs, opt_theirs, ids, args.steps, loss_parallel)
    if env.rank == 0:
        m_ours, m_theirs = statistics.median(t_ours) * 1e3, statistics.median(t_theirs) * 1e3
        print(
            f"tp={args.tp} backend={dist.get_backend()} hidden={args.hidden} layers={args.layers} "
            f"vocab={args.vocab} batch={args.batch}x{args.seq}\n"
            f"initial loss: nanolight {ours_loss:.6f}  pytorch {theirs_loss:.6f}\n"
            + "".join(
                f"kept for backward per rank, {name}: {step / 1e6:.1f} MB, of which head + loss {head / 1e6:.1f} MB\n"
                for name, (step, head) in kept.items()
            )
            + f"step time (median of {len(t_ours)}): nanolight {m_ours:.1f} ms  pytorch {m_theirs:.1f} ms  "
            f"ratio nanolight/pytorch = {m_ours / m_theirs:.3f}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
