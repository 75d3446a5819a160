"""bf16-master on one process: the fp32 bytes per parameter its optimizer holds, and the operators
the global norm and the clipping run.

    python scripts/bench_master_state.py                    # 24 blocks, smollm-1.7b's depth (tiny width)
    python scripts/bench_master_state.py --layers 8 --hidden 256

Bytes: distinct storages of the main-gradient buckets, the gradient shards the masters step with,
the fp32 masters and AdamW's two moments, over the parameter count (the bf16 compute weights add
2). Operators: ``torch.profiler`` leaf aten ops that compute (views and allocations left out), one
measured call of `global_norm` and one of `clip_` over the gradient pieces `Strategy.clip_gradients`
passes; on the CPU a foreach op's per-tensor fallback shows as its children, on CUDA each of these
is a kernel launch (a foreach op: one per ~110 tensors or 320 x 64K elements).
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from nanolight.models import LlamaConfig, LlamaForCausalLM
from nanolight.parallel.grads import clip_, global_norm
from nanolight.parallel.zero import ZeroOptimizer

NOT_COMPUTE = {
    "aten::view", "aten::as_strided", "aten::slice", "aten::reshape", "aten::_reshape_alias", "aten::empty",
    "aten::empty_strided", "aten::detach", "aten::alias", "aten::unsqueeze", "aten::expand", "aten::resize_",
    "aten::select", "aten::lift_fresh", "aten::item",
}  # fmt: skip


def fp32_bytes(zero: ZeroOptimizer) -> int:
    tensors = [b.buffer for b in zero.reducer.buckets] + list(zero.shard_grads) + list(zero.master)
    tensors += [v for st in zero.state.values() for v in st.values() if v.dim() > 0]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def compute_ops(fn: object) -> int:
    fn()  # warm up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    ops = [e for e in prof.events() if e.name.startswith("aten::") and e.name not in NOT_COMPUTE]
    return sum(
        not any(c.name.startswith("aten::") and c.name not in NOT_COMPUTE for c in e.cpu_children)
        for e in ops
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=128)
    args = parser.parse_args()
    cfg = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True, attn_implementation="eager",
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    zero = ZeroOptimizer(torch.optim.AdamW(model.parameters()), None, grad_dtype=torch.float32)
    model.to(torch.bfloat16)  # the compute weights, as `Precision.cast_to_compute` makes them
    x = torch.randint(0, args.vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    model(x, labels=x).backward()
    pieces = zero.grad_pieces({id(p) for p in model.parameters()})
    zero.step()  # AdamW's moments exist from here
    n = sum(p.numel() for p in model.parameters())
    per_param = fp32_bytes(zero) / n
    print(f"{n} parameters in {len(pieces)} gradient pieces, {len(zero.reducer.buckets)} buckets")
    print(f"fp32 bytes/param: {per_param:.2f} (with the bf16 weights: {per_param + 2:.2f})")
    print(f"global_norm: {compute_ops(lambda: global_norm(pieces))} computing ops")
    print(f"clip_: {compute_ops(lambda: clip_(pieces, torch.tensor(1e9), 1.0))} computing ops")


if __name__ == "__main__":
    main()
