"""Step time of a `Layout`: compute at a calibrated rate, communication from message sizes and
link bandwidths, overlapped where the code overlaps it, the pipeline bubble from the schedule.

    step = m * W_busiest / (1 - bubble)       the pipeline: the busiest rank's micro-batch work W
                                              (its chunks' FLOPs at the hardware's rate, plus its
                                              tp collectives), stretched by `bubble_fraction`
         + pipeline fill                      (p-1) activation hops nothing overlaps
         + exposed dp reduction               buckets go out during the last micro-batch's
                                              backward (`data_parallel.py`); what exceeds it shows,
                                              and the last bucket (25 MB) always does
         + ZeRO-1 all-gather                  after the optimizer step, nothing to hide behind
         + optimizer step                     AdamW reads p, g, m, v and writes p, m, v: memory-bound

FLOPs come from `models/llama_config.py` (6 x matmul weights + the attention scores per token, the
head on the last stage); recompute adds a block's forward again (`full`; `selective` recomputes
only elementwise ops, and eager attention's score matmuls). tp collectives (`tensor_parallel/
comm.py`) run inline with the compute: two all-reduces (or all-gather + reduce-scatter under
sequence parallelism, the same bytes) per block forward, two per backward. A ring moves
2(n-1)/n of an all-reduced buffer per rank, (n-1)/n of a reduce-scattered or all-gathered one,
after the hardware's latency; a pipeline chunk's forward and backward each cost two messages'
latency (a receive and a send), so interleaving pays v times as many.
"""

from __future__ import annotations

from nanolight.models.llama_config import stage_costs
from nanolight.parallel.pipeline.schedules import bubble_fraction
from nanolight.planner.hardware import Hardware
from nanolight.planner.layout import PRECISION_BYTES, Layout
from nanolight.planner.memory import Workload, chunk_layers, rank_parameters

ADAMW_BYTES_PER_ELEMENT = 28  # fp32 p, g, m, v read (16) + p, m, v written (12)


def _ring(n: int, nbytes: float, bandwidth: float, latency: float, all_reduce: bool = True) -> float:
    """Seconds of a ring collective over `n` ranks moving a buffer of `nbytes` (its latency once)."""
    if n == 1:
        return 0.0
    return latency + (2 if all_reduce else 1) * (n - 1) / n * nbytes / bandwidth


def core_share(hw: Hardware, layout: Layout) -> float:
    """What of a core one rank gets: 1 on a GPU; on a CPU whose cores the ranks share, its share
    of them, each busy core keeping `concurrency` of the rate it has alone."""
    if not hw.shared_cores or layout.world_size == 1:
        return 1.0
    return min(1.0, hw.shared_cores / layout.world_size) * hw.concurrency


def rank_rate(hw: Hardware, layout: Layout) -> float:
    """FLOP/s one rank's matmuls reach."""
    return hw.flops(layout.precision) * hw.efficiency * core_share(hw, layout)


def micro_batch_work(work: Workload, layout: Layout, hw: Hardware, stage: int) -> float:
    """Seconds rank `stage` spends on one micro-batch (all its chunks, forward + backward)."""
    c, tp = work.config, layout.tp
    tokens = layout.micro_batch_size * work.seq_len
    layer, _, head = stage_costs(c)  # matmul weights per block, and the head's
    attention = 12 * work.seq_len * c.head_dim * c.num_attention_heads  # FLOPs per token per block
    per_block = 6 * layer + attention
    mode = layout.activation_checkpointing
    if mode == "full":
        per_block += 2 * layer + attention / 3
    elif mode == "selective" and c.attn_implementation == "eager":
        per_block += attention / 3
    layers = sum(len(r) for r in chunk_layers(c, layout)[stage])
    flops = layers * per_block + (6 * head if stage == layout.pp - 1 else 0)
    seconds = tokens * flops / tp / rank_rate(hw, layout)
    # the host's fixed cost per block (operator dispatch), paid again by a recomputed forward
    seconds += layers * hw.block_overhead * (4 / 3 if mode == "full" else 1) / core_share(hw, layout)
    _, _, act, _ = PRECISION_BYTES[layout.precision]
    collectives = 4 + (2 if mode == "full" else 0)  # per block and micro-batch
    seconds += layers * collectives * _ring(tp, tokens * c.hidden_size * act, hw.link(tp), hw.latency)
    if layout.pp > 1:  # each chunk's forward and backward posts a receive and sends: two messages each
        seconds += 4 * layout.pp_virtual * hw.latency
    return seconds


def step_time(work: Workload, layout: Layout, hw: Hardware) -> dict[str, float]:
    """Seconds of one optimizer step, as parts, and their `total`."""
    p, v, m, dp = layout.pp, layout.pp_virtual, layout.accumulate_grad_batches, layout.dp
    w_bytes, g_bytes, act, _ = PRECISION_BYTES[layout.precision]
    busiest = max(micro_batch_work(work, layout, hw, s) for s in range(p))
    pipeline = m * busiest / (1 - bubble_fraction(m, p, v))
    tokens = layout.micro_batch_size * work.seq_len
    boundary = tokens * work.config.hidden_size * act / (layout.tp if layout.sequence_parallel else 1)
    fill = (p - 1) * boundary / hw.link(layout.tp * p) if p > 1 else 0.0
    n = max(rank_parameters(work.config, layout, s) for s in range(p))
    dp_link = hw.link(layout.world_size)
    if layout.zero_stage == 1:
        reduce = _ring(dp, n * g_bytes, dp_link, hw.latency, all_reduce=False)
        gather = _ring(dp, n * w_bytes, dp_link, hw.latency, all_reduce=False)
        stepped = n / dp
    else:
        reduce, gather, stepped = _ring(dp, n * g_bytes, dp_link, hw.latency), 0.0, n
    last_backward = busiest * 2 / 3  # the buckets' window: the last micro-batch's backward
    last_bucket = min(work.bucket_bytes, n * g_bytes) / (n * g_bytes) * reduce  # launched after backward
    exposed = max(reduce - last_backward, last_bucket) if reduce else 0.0
    optimizer = (ADAMW_BYTES_PER_ELEMENT * stepped + n * g_bytes) / hw.memory_bandwidth  # + the norm's read
    parts = {
        "compute": m * busiest,
        "bubble": pipeline - m * busiest,
        "pipeline_fill": fill,
        "dp_reduce_exposed": exposed,
        "zero_all_gather": gather,
        "optimizer": optimizer,
    }
    parts["total"] = sum(parts.values())
    return parts
