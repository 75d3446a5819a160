"""Bytes each rank sends per optimizer step, by group, against each layout's algorithmic minimum.

    python scripts/bench_traffic.py [--presets smollm-135m smollm-1.7b] [--traffic-seq-len 256]
                                    [--micro-batches 2] [--layouts dp8 tp2dp4 cp2dp4 pp4v2]
                                    [--layers N] [--json out.json]

(`scripts/bench_counts.py --layouts ...` prints the same table after its other counts.)

Measured: the real program -- the recipe's module, `Parallel3DStrategy`, AdamW with ZeRO-1,
the trainer's step, bf16-true -- with every collective and point-to-point message of the
second step recorded as it passes the dispatcher, with its group and tensor bytes (the dry
run's `Traffic`, `nanolight/pretrain/dry_run.py`). dp, tp and cp layouts run as the dry run
runs them (one rank of the full world, fake tensors, torch's fake process group: exact shapes,
no storage); the dry run cannot run pipeline parallelism yet, so pp runs for real: four gloo
processes on this CPU, real tensors, the same recorder (`measured_fit`), 8 micro-batches of 64 tokens.

A collective's tensor bytes S become bytes sent per rank by the bandwidth-optimal (ring)
algorithm over n ranks, what NCCL's ring sends: all-reduce 2(n-1)/n·S, reduce-scatter
(n-1)/n·S of its input, all-gather (n-1)/n·S of its output, broadcast S, a send S, a receive 0.

Algorithmic minima, per rank per step, bf16 (B = 2 bytes), m micro-batches of b×s tokens,
hidden h, L layers, P parameters (the tied embedding once), P_tp a tp rank's share (matrices
and the vocabulary split tp ways, norms whole):
- ZeRO-1 over n ranks (dp, or dp·cp): every gradient summed over the replicas and every
  updated weight back on every replica. A reduce-scatter of the gradients leaves each rank the
  1/n it steps and an all-gather returns the weights: 2·(n-1)/n·P·B (a ring all-reduce is
  exactly a reduce-scatter plus an all-gather, so nothing less moves the sum; fp32 gradients
  or an all-reduce instead of the reduce-scatter would send 1.5× this -- as ``bf16-master``
  does by choice, reducing in fp32 like Megatron's main gradients: hence bf16-true here).
- tp with sequence parallelism (Korthikanti et al., arXiv 2205.05198, section 4.2.2): a layer's
  two tp regions each start with an all-gather of the (b,s,h) activation and end with a
  reduce-scatter; the backward runs their transposes: 8·(tp-1)/tp·b·s·h·B per layer and micro-
  batch, plus the vocabulary-parallel embedding's reduce-scatter and the head's all-gather, each
  with its transpose (4 more); the dp part is ZeRO-1's over P_tp. (The loss's per-token
  max/sum all-reduces and the norm weights' gradient sums are O(b·s + L·h): not in the minimum.)
- cp ring (`parallel/ring_attention.py`, zigzag, grouped K/V): a rank's K and V, KV =
  2·b·(s/cp)·h_kv·B, must reach the cp-1 others in the forward; the backward needs them again
  (or cp blocks of memory) and each rank's partial dK, dV for every other block must reach its
  owner: 3·(cp-1)·KV per layer and micro-batch; the replica's ZeRO-1 runs over dp·cp.
- pp, interleaved with v chunks per rank (pp·v chunks in a ring of pp ranks): every micro-batch
  crosses each of the pp·v-1 chunk boundaries once forward (a (b,s,h) activation) and once
  backward (its gradient). A rank sends forward from each of its v chunks but the model's last,
  and backward from each but the model's first: (2v - [rank is first] - [rank is last])·m·b·s·h·B.
  The tied embedding's gradient is summed between the first and last rank: V·h·B each way.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a source checkout, not installed
from nanolight.errors import UsageError  # noqa: E402
from nanolight.models import LlamaConfig  # noqa: E402
from nanolight.models.llama_config import num_params  # noqa: E402
from nanolight.parallel.config import ParallelConfig  # noqa: E402
from nanolight.planner.hardware import hardware  # noqa: E402
from nanolight.pretrain.config import ClusterConfig, PretrainConfig, TrainConfig  # noqa: E402
from nanolight.pretrain.dry_run import GROUP_NAMES, Message, dry_run, measured_fit  # noqa: E402
from nanolight.pretrain.run import build_strategy, check_layout  # noqa: E402

BYTES = 2  # bf16
STEP = 1  # the second step: the pipeline's first exchange of shapes is behind it
PRECISION = "bf16-true"  # bf16 weights, gradients and their reduction: the minimum's bytes
LAYOUTS = {  # name -> ParallelConfig's knobs
    "dp8": {"dp": 8},
    "tp2dp4": {"tp": 2, "dp": 4, "sequence_parallel": True},
    "cp2dp4": {"cp": 2, "dp": 4},
    "pp4v2": {"pp": 4, "pp_schedule": "interleaved_1f1b", "pp_virtual": 2},
}
PP_SEQ_LEN = 64  # the pipeline's real run: real tensors, four processes on this CPU
PP_MICRO_BATCHES = 8  # interleaving takes them in groups of pp
PP_MAX_PARAMS = 200_000_000  # ... whose weights, gradients and AdamW state must fit this machine


def layout_config(
    preset: str, layout: str, seq_len: int, micro_batches: int, layers: int | None = None
) -> PretrainConfig:
    """The layout's run of `preset` (`layers`: its decoder layers instead of the preset's)."""
    knobs = LAYOUTS[layout]
    return PretrainConfig(
        model=LlamaConfig.preset(preset, **({"num_hidden_layers": layers} if layers else {})),
        trainer=TrainConfig(
            micro_batch_size=1,
            seq_len=PP_SEQ_LEN if "pp" in knobs else seq_len,
            accumulate_grad_batches=PP_MICRO_BATCHES if "pp" in knobs else micro_batches,
            precision=PRECISION,
        ),
        parallel=ParallelConfig(zero_stage=1, **knobs),
        cluster=ClusterConfig(gpu="h100-sxm"),
    )


# ---- measured --------------------------------------------------------------------------------
def sent_bytes(m: Message) -> float:
    """Bytes this rank sends for `m` under the ring algorithm (the module docstring)."""
    n = len(m.ranks)
    if m.op in ("send",):
        return m.nbytes
    if m.op.startswith("allreduce"):
        return 2 * (n - 1) / n * m.nbytes
    if m.op.startswith(("_reduce_scatter", "reduce_scatter", "_allgather", "allgather", "alltoall")):
        return (n - 1) / n * m.nbytes
    if m.op.startswith("broadcast"):
        return m.nbytes
    return 0.0  # a receive, a barrier


def by_group(messages: list[Message]) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for m in messages:
        if m.step == STEP:  # a group the context does not name (the tied embedding's): its ranks
            named = m.group in GROUP_NAMES
            out[m.group if named else "ranks " + ",".join(map(str, m.ranks))] += sent_bytes(m)
    return dict(out)


def _pp_rank(rank: int, world: int, port: int, config: PretrainConfig, results: Any) -> None:
    """One pipeline rank of a real gloo world: the recipe's program, its messages recorded."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    strategy = build_strategy(config)
    strategy.setup_environment()  # joins the world; the groups exist from here
    ctx = strategy.parallel.context
    names = {tuple(ctx.ranks(name)): name for name in reversed(GROUP_NAMES)}  # earlier names win
    _, traffic, _ = measured_fit(config, strategy, hardware("h100-sxm"), names)
    results.put((rank, by_group(traffic.messages)))


def measured_pp(config: PretrainConfig) -> list[dict[str, float]]:
    """Every pipeline rank's bytes by group: a real run, at a size this machine runs (the dry run
    runs pp too now; taking smollm-1.7b's pp count from it is open). A rank that dies stops the
    count at once, naming its exit code, rather than leaving the others waiting."""
    world = config.parallel.pp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_pp_rank, args=(r, world, port, config, results)) for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, dict[str, float]] = {}
    while len(got) < world:
        try:
            rank, row = results.get(timeout=5)
            got[rank] = row
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode]
            if dead:
                for p in procs:
                    p.terminate()
                raise RuntimeError(f"a pipeline rank exited with {dead[0]}") from None
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"a pipeline rank exited with {p.exitcode}")
    return [got[r] for r in range(world)]


def measured(config: PretrainConfig) -> list[dict[str, float]]:
    """Bytes by group for each rank role (one role without pp: every rank sends alike)."""
    if config.parallel.pp > 1:
        return measured_pp(config)
    return [by_group(role.messages) for role in dry_run(config).roles]


# ---- the minimum -------------------------------------------------------------------------------
def minimum(config: PretrainConfig) -> list[dict[str, float]]:
    """Each rank role's minimum bytes by group (the module docstring's derivations)."""
    from nanolight.planner.layout import Layout
    from nanolight.planner.memory import rank_parameters

    c, p, t = config.model, config.parallel, config.trainer
    m, b, s, h = t.accumulate_grad_batches, t.micro_batch_size, t.seq_len, c.hidden_size
    act = b * s * h * BYTES  # one (b, s, h) activation
    layout = Layout(**{k: getattr(p, k) for k in ParallelConfig.knobs()})
    roles = []
    for stage in range(p.pp):
        out: dict[str, float] = {}
        replicas = p.dp * p.cp
        if replicas > 1:  # ZeRO-1: reduce-scatter the gradients, all-gather the weights
            name = "dp" if p.cp == 1 else "replica"
            out[name] = 2 * (replicas - 1) / replicas * rank_parameters(c, layout, stage) * BYTES
        if p.tp > 1:  # two all-gathers and two reduce-scatters per layer and their transposes
            out["tp"] = (8 * c.num_hidden_layers + 4) * (p.tp - 1) / p.tp * act * m
        if p.cp > 1:  # K, V to every other rank forward and backward, dK, dV back to their owner
            kv = 2 * b * (s // p.cp) * c.num_key_value_heads * c.head_dim * BYTES
            out["cp"] = 3 * (p.cp - 1) * kv * c.num_hidden_layers * m
        if p.pp > 1:
            v, first, last = p.pp_virtual, stage == 0, stage == p.pp - 1
            out["pp"] = (2 * v - first - last) * m * act
            if c.tie_word_embeddings and (first or last):  # its gradient, summed by the two ends
                out[f"ranks 0,{p.pp - 1}"] = c.vocab_size * h * BYTES
        roles.append(out)
    return roles


# ---- the report ------------------------------------------------------------------------------
def measure(
    presets: list[str], layouts: list[str], seq_len: int, micro_batches: int, layers: int | None = None
) -> dict[str, Any]:
    """preset -> layout -> one row per rank role: {group: [measured, minimum]}."""
    out: dict[str, Any] = {}
    for preset in presets:
        out[preset] = {}
        for layout in layouts:
            config = layout_config(preset, layout, seq_len, micro_batches, layers)
            if config.parallel.pp > 1 and num_params(config.model) > PP_MAX_PARAMS:
                out[preset][layout] = (
                    f"skipped: a real {config.parallel.pp}-rank run of this size does not fit here"
                )
                continue
            try:
                check_layout(config)
            except UsageError as err:  # e.g. tp=2 and smollm-135m's 9 heads
                out[preset][layout] = f"skipped: {err}"
                continue
            rows = []
            least_bytes = minimum(config)  # first: a mistake here shows before minutes of measuring
            for got, least in zip(measured(config), least_bytes, strict=True):
                groups = sorted(set(got) | set(least))
                rows.append({g: [got.get(g, 0.0), least.get(g, 0.0)] for g in groups})
            out[preset][layout] = rows
            print(f"{preset} {layout}: {json.dumps(rows)}", file=sys.stderr, flush=True)  # as it goes
    return out


def report(m: dict[str, Any], seq_len: int, micro_batches: int) -> None:
    print(
        f"bytes sent per rank per step, {PRECISION}, {micro_batches} micro-batches of 1 x {seq_len} tokens "
        f"(pp: {PP_MICRO_BATCHES} of 1 x {PP_SEQ_LEN}), measured vs the algorithmic minimum"
    )
    print(
        f"{'preset':<13}{'layout':<8}{'rank':>5}  {'group':<10}{'measured MiB':>14}{'minimum MiB':>13}{'ratio':>8}"
    )
    for preset, layouts in m.items():
        for layout, rows in layouts.items():
            if isinstance(rows, str):
                print(f"{preset:<13}{layout:<8}{'':>5}  {rows}")
                continue
            for rank, row in enumerate(rows):
                for group, (got, least) in row.items():
                    ratio = f"{got / least:8.3f}" if least else "       -"
                    print(
                        f"{preset:<13}{layout:<8}{rank:>5}  {group:<10}{got / 2**20:>14.2f}{least / 2**20:>13.2f}{ratio}"
                    )
                got, least = (sum(v[i] for v in row.values()) for i in (0, 1))
                print(f"{'':<26}{'total':<10}{got / 2**20:>14.2f}{least / 2**20:>13.2f}{got / least:8.3f}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--traffic-seq-len", type=int, default=256, help="tokens per sequence (pp: 64)")
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--layers", type=int, help="decoder layers instead of the preset's (pp4v2 needs 8)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="*", default=["smollm-135m", "smollm-1.7b"])
    p.add_argument("--json", help="also write the figures here")
    add_arguments(p)
    args = p.parse_args()
    m = measure(args.presets, args.layouts, args.traffic_seq_len, args.micro_batches, args.layers)
    report(m, args.traffic_seq_len, args.micro_batches)
    if args.json:
        Path(args.json).write_text(json.dumps(m, indent=1))


if __name__ == "__main__":
    main()
