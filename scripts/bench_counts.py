"""Counts that predict a GPU step, measured on CPU: deterministic, no timings, side by side.

    python scripts/bench_counts.py [--presets smollm-135m smollm-1.7b] [--seq-len 64]
                                   [--worlds 8 64 1024 4096] [--layouts dp8 tp2dp4 cp2dp4 pp4v2]
                                   [--json out.json]

1. aten operations dispatched per decoder layer, forward + backward, eager (a `TorchDispatchMode`
   counting every op, bf16, SDPA, real tensors of one layer on CPU), nanolight's `DecoderLayer` vs
   transformers' `LlamaDecoderLayer` on the same config; the ops among them that read a device
   value back (host syncs on a GPU); graph breaks of the layer under ``torch.compile`` (dynamo's
   `explain`).
2. Bytes a layer keeps for its backward, bf16, under none / selective / full recompute (what one
   layer's forward allocates and still holds, its output aside: the CPU profiler's allocations
   minus frees; `saved_bytes`), against Korthikanti et al.'s accounting (arXiv 2205.05198,
   section 4) applied to a Llama layer and nanolight's recompute policies: see `formula_bytes`.
3. World-wide collectives at start-up and per step at 8 ... 4,096 ranks: torch's fake process
   group (``torch.testing._internal.distributed.fake_pg``: one simulated rank of the large world)
   running the real `ParallelContext` and its per-step agreement (`agree_max`), every group
   creation and collective counted as it is called. Under NCCL with a bound device every group-
   creation call is one ``ncclCommSplit`` that the whole world joins; one made with
   ``use_local_synchronization`` (the path without a bound device) only its members meet.
4. The per-step agreement's store requests per rank at several world sizes (ranks as threads, one
   real `TCPStore`): they must not grow with the world.
5. Bytes each rank sends per step, by group, for dp8 ZeRO-1, tp2·dp4, cp2·dp4 and pp4 interleaved,
   against each layout's algorithmic minimum: `scripts/bench_traffic.py` (its docstring derives
   the minima), printed here too.

Targets (the README's performance section): ops per layer <= transformers'; 0 host syncs and 0
graph breaks; saved bytes within 5% of the formula; start-up world-wide calls O(mesh dimensions);
per-step world-wide collectives 0 and per-rank requests constant; bytes per rank within 10% of
each layout's minimum.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a source checkout, not installed
import bench_traffic  # noqa: E402  (scripts/, this file's directory)

from nanolight.models import LlamaConfig  # noqa: E402
from nanolight.models.llama import DecoderLayer  # noqa: E402
from nanolight.models.llama_rope import rope_cos_sin, rope_inv_freq  # noqa: E402
from nanolight.parallel.agreement import StoreAgreements  # noqa: E402
from nanolight.parallel.blocks import apply_activation_checkpointing  # noqa: E402
from nanolight.parallel.context import ParallelContext  # noqa: E402

DTYPE = torch.bfloat16
BYTES = 2  # bf16
aten = torch.ops.aten
SYNC_OPS = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default}


# ---- 1. operations per layer ------------------------------------------------------------------
class OpCounter(TorchDispatchMode):
    """Every aten op dispatched while active; `syncs`: those that read a value back to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))

    @property
    def syncs(self) -> int:
        return sum(n for op, n in self.ops.items() if op in SYNC_OPS or op.overloadpacket is aten.nonzero)


def layers(preset: str) -> tuple[LlamaConfig, torch.nn.Module, torch.nn.Module, Any]:
    """nanolight's layer, transformers' layer on the same config (same weights), and transformers'
    rotary embedding; bf16, SDPA."""
    import transformers
    from transformers.models.llama import modeling_llama

    from nanolight.models.hf_adapter import config_to_hf

    config = LlamaConfig.preset(preset, attn_implementation="sdpa")
    torch.manual_seed(0)
    ours = DecoderLayer(config).to(DTYPE)
    hf_config = transformers.LlamaConfig(**config_to_hf(config, {}, DTYPE))
    hf_config._attn_implementation = "sdpa"
    theirs = modeling_llama.LlamaDecoderLayer(hf_config, layer_idx=0).to(DTYPE)
    return config, ours, theirs, modeling_llama.LlamaRotaryEmbedding(hf_config)


def layer_calls(preset: str, seq_len: int, batch: int = 1) -> dict[str, Callable[[], torch.Tensor]]:
    """name -> one forward of that layer on the same input (the rotary tables made outside, as
    both models make them once per forward)."""
    config, ours, theirs, rotary = layers(preset)
    x = torch.randn(batch, seq_len, config.hidden_size, dtype=DTYPE, requires_grad=True)
    positions = torch.arange(seq_len)[None]
    inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    cos, sin = rope_cos_sin(positions, inv_freq, DTYPE)
    embeddings = rotary(x, positions)
    return {
        "nanolight": lambda: ours(x, cos, sin),
        "transformers": lambda: theirs(x, position_embeddings=embeddings, position_ids=positions),
    }


def ops_per_layer(preset: str, seq_len: int) -> dict[str, dict[str, int]]:
    out = {}
    for name, forward in layer_calls(preset, seq_len).items():
        y = forward()
        grad = torch.randn_like(y)
        y.backward(grad)  # once before counting: nothing lazy is counted
        counter = OpCounter()
        with counter:
            forward().backward(grad)
        out[name] = {"ops": sum(counter.ops.values()), "host_syncs": counter.syncs}
    return out


def graph_breaks(preset: str, seq_len: int) -> int:
    """Graph breaks dynamo finds in nanolight's layer, forward (the backward is AOT autograd's)."""
    import torch._dynamo

    forward = layer_calls(preset, seq_len)["nanolight"]
    torch._dynamo.reset()
    return torch._dynamo.explain(forward)().graph_break_count


# ---- 2. bytes saved for backward ----------------------------------------------------------------
def held_bytes(preset: str, seq_len: int, mode: str, batch: int = 1) -> int:
    """What one layer's forward allocates and still holds when it returns, its output aside."""
    config = LlamaConfig.preset(preset, attn_implementation="sdpa")
    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.pp_plan = {"layers": "layers"}  # the blocks `apply_activation_checkpointing` finds
    holder.layers = torch.nn.ModuleDict({"0": DecoderLayer(config).to(DTYPE)})
    apply_activation_checkpointing(holder, mode)
    layer = holder.layers["0"]
    x = torch.randn(batch, seq_len, config.hidden_size, dtype=DTYPE, requires_grad=True)
    inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    cos, sin = rope_cos_sin(torch.arange(seq_len)[None], inv_freq, DTYPE)
    layer(x, cos, sin).sum().backward()  # once first: nothing lazy is counted
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        y = layer(x, cos, sin)
    return sum(e.self_cpu_memory_usage for e in prof.events()) - y.numel() * y.element_size()


def saved_bytes(preset: str, seq_len: int, mode: str) -> int:
    """The activations a layer keeps for its backward at `seq_len` tokens: what the forward holds
    at 2·seq_len minus what it holds at seq_len (what does not grow with the tokens cancels), plus
    the layer's input, which every mode keeps (the first norm's, or the recompute's) and which the
    caller allocated."""
    config = LlamaConfig.preset(preset)
    grown = held_bytes(preset, 2 * seq_len, mode) - held_bytes(preset, seq_len, mode)
    return grown + BYTES * seq_len * config.hidden_size


def formula_bytes(config: LlamaConfig, s: int, b: int, mode: str) -> int:
    """Korthikanti et al.'s count of the activations a layer keeps (section 4.1), term by term for
    a Llama layer in bf16 (their GPT layer: 34·sbh + 5·a·s²b; here no dropout masks, SwiGLU for
    GeLU, RMSNorm for LayerNorm, grouped K/V, and a fused attention kernel that keeps its output
    and the fp32 log-sum-exp instead of the s² scores -- the part their selective recompute drops).

    none:      each norm's input and fp32 1/rms; the q/k/v projection's input; q, k, v after RoPE;
               the attention output (the o projection's input) and its log-sum-exp; the MLP's
               input, the gate/up output (SwiGLU's backward) and silu(gate), the down projection's
               input -- h, h_kv, I the hidden, grouped K/V and intermediate widths.
    selective: nanolight's policy (`parallel/blocks.py`): the layer's input, every matmul's output
               (q/k/v, o, gate/up, down) and the attention kernel's output and log-sum-exp; the
               rest is recomputed.
    full:      the layer's input only (their 2·sbh).
    """
    h, a, i = config.hidden_size, config.num_attention_heads, config.intermediate_size
    kv = config.num_key_value_heads * config.head_dim
    sb = s * b
    x = BYTES * sb * h  # one hidden-sized activation
    attention_out = x + 4 * sb * a  # the kernel's output and its fp32 log-sum-exp per head
    if mode == "full":
        return x
    if mode == "selective":
        return x + BYTES * sb * (h + 2 * kv) + attention_out + x + BYTES * sb * 2 * i + x
    norms = 2 * (x + 4 * sb)  # input, fp32 1/rms, twice
    attention = x + BYTES * sb * (h + 2 * kv) + attention_out
    mlp = x + BYTES * sb * 2 * i + BYTES * sb * i + BYTES * sb * i
    return norms + attention + mlp


# ---- 3. world-wide collectives -------------------------------------------------------------------
GROUP_CALLS = ("new_group", "split_group")
COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "broadcast_object_list",
    "all_gather",
    "barrier",
    "all_gather_object",
)


@contextmanager
def counting_calls(world: int) -> Iterator[Counter]:
    """Each group creation ("world-wide" unless made with ``use_local_synchronization``, which only
    its members meet) and each collective over the whole world, counted as `torch.distributed` is
    called (its functions wrapped for the duration, as `tests/_nccl_emulation.py` records them)."""
    seen: Counter = Counter()
    originals = {name: getattr(dist, name) for name in GROUP_CALLS + COLLECTIVES}

    def counted(name: str, fn: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            if name in GROUP_CALLS:
                local = name == "new_group" and kwargs.get("use_local_synchronization", False)
                seen["group calls"] += 1
                seen["world-wide group calls"] += 0 if local else 1
            else:
                group = kwargs.get("group")
                if group is None or dist.get_world_size(group) == world:
                    seen["world-wide collectives"] += 1
            return fn(*args, **kwargs)

        return call

    for name, fn in originals.items():
        setattr(dist, name, counted(name, fn))
    try:
        yield seen
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def mesh_for(world: int) -> dict[str, int]:
    """The issue's layout (tp 8, pp 4, dp the rest), tp 2 pp 2 below 32 ranks."""
    return {"tp": 8, "pp": 4} if world >= 32 else {"tp": 2, "pp": 2}


def world_collectives(world: int, rank: int = 0) -> dict[str, int]:
    """Start-up (the context, its groups, the first agreement's address) and one step's agreement,
    as global rank `rank` of a fake world of `world` ranks makes them."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        with counting_calls(world) as startup:
            ctx = ParallelContext(**mesh_for(world), timeout=timedelta(seconds=30))
            ctx.agree_max(0)  # the first one hands rank 0's store address round
        with counting_calls(world) as step:
            ctx.agree_max(0)
        return {
            "group calls per rank": startup["group calls"],
            "world-wide group calls (NCCL, bound device)": startup["group calls"],
            "world-wide group calls (here)": startup["world-wide group calls"],
            "world-wide collectives at start-up": startup["world-wide collectives"],
            "world-wide collectives per step": step["world-wide collectives"],
        }
    finally:
        dist.destroy_process_group()


class CountingClient:
    """One rank's store connection, counting the requests it sends."""

    def __init__(self, store: Any) -> None:
        self.store, self.requests = store, 0

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        def request(*args: Any, **kwargs: Any) -> Any:
            self.requests += 1
            return method(*args, **kwargs)

        return request


def agreement_requests(world: int, steps: int = 4) -> float:
    """Store requests per rank per step of the agreement, `world` ranks as threads (no signal)."""
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False
    )
    clients = [
        CountingClient(dist.TCPStore("127.0.0.1", server.port, timeout=timedelta(seconds=60)))
        for _ in range(world)
    ]

    def rank(r: int) -> None:
        agreements, pending = StoreAgreements(clients[r], world), None
        for _ in range(steps):  # as the trainer: read the previous step's, start this one's
            if pending is not None:
                pending.wait()
            pending = agreements.start(0)
        pending.wait()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(c.requests for c in clients) / (world * steps)


# ---- the report ------------------------------------------------------------------------------
def measure(presets: list[str], seq_len: int, worlds: list[int], thread_worlds: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {"layers": {}, "saved": {}, "worlds": {}, "agreement": {}}
    for preset in presets:
        out["layers"][preset] = {
            **ops_per_layer(preset, seq_len),
            "graph_breaks": graph_breaks(preset, seq_len),
        }
        config = LlamaConfig.preset(preset)
        out["saved"][preset] = {
            mode: {
                "measured": saved_bytes(preset, seq_len, mode),
                "formula": formula_bytes(config, seq_len, 1, mode),
            }
            for mode in ("none", "selective", "full")
        }
    for world in worlds:
        out["worlds"][world] = world_collectives(world)
    for world in thread_worlds:
        out["agreement"][world] = agreement_requests(world)
    return out


def report(m: dict[str, Any], seq_len: int) -> None:
    print(f"torch {torch.__version__}, bf16, SDPA, one decoder layer, batch 1 x {seq_len} tokens, CPU")
    print(f"{'preset':<14}{'nanolight ops':>14}{'transformers':>14}{'host syncs':>12}{'graph breaks':>14}")
    for preset, row in m["layers"].items():
        ours, theirs = row["nanolight"], row["transformers"]
        print(
            f"{preset:<14}{ours['ops']:>14}{theirs['ops']:>14}{ours['host_syncs']:>12}{row['graph_breaks']:>14}"
        )
    print(f"\n{'preset':<14}{'recompute':<11}{'saved KiB':>11}{'formula KiB':>13}{'ratio':>8}")
    for preset, modes in m["saved"].items():
        for mode, v in modes.items():
            ratio = v["measured"] / v["formula"]
            print(
                f"{preset:<14}{mode:<11}{v['measured'] / 1024:>11.1f}{v['formula'] / 1024:>13.1f}{ratio:>8.3f}"
            )
    if m["worlds"]:
        keys = list(next(iter(m["worlds"].values())))
        print("\nfake world of N ranks (global rank 0), tp 8 x pp 4 x dp N/32 (tp 2 x pp 2 below 32):")
        for key in keys:
            print(f"  {key:<44}" + "".join(f"{m['worlds'][w][key]:>7}" for w in m["worlds"]) + "   N = "
                  + ", ".join(map(str, m["worlds"])))  # fmt: skip
    if m["agreement"]:
        print("\nthe per-step agreement's store requests per rank per step (ranks as threads, no signal): "
              + ", ".join(f"{n} ranks {v:.2f}" for n, v in m["agreement"].items()))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="*", default=["smollm-135m", "smollm-1.7b"])
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--worlds", nargs="*", type=int, default=[8, 64, 1024, 4096])
    p.add_argument("--thread-worlds", nargs="*", type=int, default=[8, 64, 256])
    p.add_argument("--json", help="also write the figures here")
    bench_traffic.add_arguments(p)
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    m = measure(args.presets, args.seq_len, args.worlds, args.thread_worlds)
    m["traffic"] = bench_traffic.measure(
        args.presets, args.layouts, args.traffic_seq_len, args.micro_batches, args.layers
    )
    report(m, args.seq_len)
    print()
    bench_traffic.report(m["traffic"], args.traffic_seq_len, args.micro_batches)
    if args.json:
        Path(args.json).write_text(json.dumps(m, indent=1, default=str))


if __name__ == "__main__":
    main()
