"""Step time of a `Layout`: compute at a calibrated rate, communication counted from the code --
every collective and message with its bytes -- overlapped where the code overlaps it, the
pipeline bubble from the schedule.

    step = m * W_busiest / (1 - bubble)       the pipeline: the busiest rank's micro-batch work W
                                              (its chunks' FLOPs at the hardware's rate, its host
                                              cost, its tp collectives, the ring's exposed
                                              exchanges, its pipeline messages), stretched by
                                              `bubble_fraction`; on shared CPU cores the stages
                                              that work in the fill and drain have the cores the
                                              idle ones left (one stage's ranks at a time), and
                                              with more ranks than cores the cores never idle:
                                              the step is then every rank's work over them, unless
                                              the busiest stage's path is longer
         + pipeline fill                      (p-1) activation hops nothing overlaps
         + step collectives                   once per step: the tied embedding's gradient between
                                              the end stages, sequence parallelism's norm weights
         + exposed dp reduction               buckets go out during the last micro-batch's
                                              backward (`data_parallel.py`); what exceeds it shows,
                                              and the last bucket (25 MB) always does
         + ZeRO-1 all-gather                  after the optimizer step, nothing to hide behind
         + optimizer step                     memory-bound: on a GPU every operator between backward
                                              and the next forward (`optimizer_bytes`: zeroing,
                                              dp's division, the norm, the clip, AdamW, ZeRO-1's
                                              copies); on a CPU AdamW's p, g, m, v read, p, m, v written

On hardware at hand (`Hardware.profiled`: this machine's CPU) the block's and the head's compute
is timed at the rank's shapes instead (`planner/probes.py`), host cost and elementwise ops
included. Under tp the block is timed in as many forked ranks as the run has on the cores,
computing at once with its collectives (`rank_block_seconds`): each collective waits for the
slower rank, a cost no latency figure captures. Without tp a rank's block is timed alone and
scaled by its core share: dp's and pp's ranks meet only at a step's end or a stage boundary, and a
pipeline's ranks are not all busy at once (timing them busy together ranked pp2 and dp2 worse in
bench_planner: Spearman 0.61-0.82 against 0.77-0.96). With more ranks than cores a rank that
waits for its pipeline peer gives its core away, so the cores never idle (`step_time`). A
datasheet GPU counts FLOPs at its efficiency; the GPU a run is on (`hardware.at_hand`) also
floors each block at the host's measured cost of issuing its kernels. FLOPs come from
`models/llama_config.py` (6 x matmul weights + the attention scores per token, the head on the
last stage); a rank holds 1/cp of each sequence's tokens, and zigzag gives it 1/cp of the causal
attention. Recompute adds a block's forward again (`full`; `selective` recomputes only
elementwise ops, and eager attention's score matmuls) -- but either mode re-runs the forward's
operators and collectives (`parallel/blocks.py`), so both pay the forward's host cost and tp
collectives again.

A datasheet GPU also pays the bytes of the non-matmul operators (`elementwise_bytes`): eager
PyTorch runs each norm, RoPE, SwiGLU, residual add, cast and gradient accumulation as its own
kernel, which reads and writes its tensors at the memory bandwidth -- in one smollm-1.7b layer at
bf16-master, 0.83 MB a token, 60% of the time its matmuls take at the peak. `ELEMENTWISE_BYTES` holds them
per token per hidden and per intermediate element and per weight per micro-batch, by precision and
recompute mode, as the dry run's roofline (`pretrain/roofline.py`) counts them in the code's own
layer (`tests/test_roofline.py` holds the table to it): what makes bf16-mixed slower than
bf16-master at equal FLOPs (fp32 weights cast each micro-batch, fp32 gradients accumulated) and
recompute dearer than its FLOPs. The matmuls' `efficiency` stays theirs.

Each collective or message costs the hardware's `latency` and then its bytes (Hockney): a ring
moves 2(n-1)/n of an all-reduced buffer per rank, (n-1)/n of a reduce-scattered or all-gathered
one. On a CPU that latency is measured between busy ranks (`hardware.gloo_bandwidth`): training's
ranks compute between collectives and wait for each other there. The counts (`tp_collectives`,
`pipeline_messages`, `ring_block_bytes`) are read off the code that issues them. A CPU whose cores
the ranks already fill overlaps nothing: gloo's copies and sums run on those same cores.
"""

from __future__ import annotations

import math

import torch

from nanolight.models.fused_loss import chunk_rows
from nanolight.models.llama_config import attention_flops_per_token, stage_costs
from nanolight.parallel.pipeline.schedules import bubble_fraction
from nanolight.planner.hardware import Hardware
from nanolight.planner.layout import PRECISION_BYTES, Layout
from nanolight.planner.memory import Workload, rank_parameters, stage_layers
from nanolight.planner.probes import MAX_RANKS, block_seconds, head_seconds, rank_block_seconds

ADAMW_BYTES_PER_ELEMENT = 28  # fp32 p, g, m, v read (16) + p, m, v written (12)
# (precision, recompute) -> bytes the non-matmul operators of one decoder layer move per micro-batch:
# (per token and hidden element, per token and intermediate element, per weight), counted by the
# dry run's roofline in smollm-1.7b's layer (H 2,048, I 8,192), its memory-bound operators only
# (`Roofline.bound_bytes`: the matmuls are the FLOPs term's, and counting their bytes too had
# overcharged bf16-master's layer by 30%): the per-token parts from layers, sequence lengths and a
# layer of half the intermediate width apart, the per-weight part from one micro-batch more
# (gradient accumulation, bf16-mixed's weight casts). Full recompute adds only matmuls to selective.
ELEMENTWISE_BYTES = {
    ("32-true", "none"): (329.4, 56.0, 12.0),
    ("32-true", "selective"): (453.9, 76.0, 12.0),
    ("32-true", "full"): (453.9, 76.0, 12.0),
    ("bf16-mixed", "none"): (321.4, 28.0, 24.0),
    ("bf16-mixed", "selective"): (435.9, 38.0, 30.0),
    ("bf16-mixed", "full"): (435.9, 38.0, 30.0),
    ("bf16-master", "none"): (292.8, 28.0, 10.0),
    ("bf16-master", "selective"): (399.0, 38.0, 10.0),
    ("bf16-master", "full"): (399.0, 38.0, 10.0),
    ("bf16-true", "none"): (292.8, 28.0, 6.0),
    ("bf16-true", "selective"): (399.0, 38.0, 6.0),
    ("bf16-true", "full"): (399.0, 38.0, 6.0),
}
# precision -> the bytes outside the decoder layers per micro-batch (the embedding, the final norm,
# the fused head + loss), by the same roofline in smollm-1.7b (two model depths apart, pp 1):
# (per token and vocabulary-slice element: the loss's passes over each chunk's fp32 logits, besides
# each chunk's fp32 d-weight update, counted from `fused_loss.py`'s chunks in `head_bytes`; per token
# and hidden element, whole at any tp: the embedding's and the final norm's full-width rows, from tp 1
# and 2 with sp (tp 4 then within 1%); per vocabulary-slice x hidden weight: the head's and the
# embedding's gradients, bf16-mixed's weight cast)
HEAD_BYTES = {
    "32-true": (56.5, 41.5, 25.9),
    "bf16-mixed": (48.5, 45.4, 38.0),
    "bf16-master": (48.9, 19.0, 28.0),
    "bf16-true": (48.9, 19.0, 24.0),
}
# ring attention's (cp > 1) bytes besides, per token and hidden element over tp: once (its blocks
# and merges in place of one flash call), and per ring step (cp - 1); bf16-master at cp 2 and 4
RING_BYTES = (287.0, 207.5)


def ring_seconds(n: int, nbytes: float, bandwidth: float, latency: float, all_reduce: bool = True) -> float:
    """Seconds of a ring collective over `n` ranks moving a buffer of `nbytes` (its latency once)."""
    if n == 1:
        return 0.0
    return latency + (2 if all_reduce else 1) * (n - 1) / n * nbytes / bandwidth


def core_share(hw: Hardware, layout: Layout, busy: int | None = None) -> float:
    """What of a core one rank gets while `busy` ranks (all of them unless told) compute: 1 on a
    GPU; on a CPU whose cores the ranks share, its share of them, each busy core keeping
    `concurrency` of the rate it has alone."""
    busy = layout.world_size if busy is None else busy
    if not hw.shared_cores or busy == 1:
        return 1.0
    return min(1.0, hw.shared_cores / busy) * hw.concurrency


def overlaps(hw: Hardware, layout: Layout) -> bool:
    """Whether communication can run behind computation: on a GPU (copy engines, NVLink), and on
    a CPU only with cores to spare (gloo moves and sums the bytes on the cores the ranks use)."""
    return not hw.shared_cores or layout.world_size < hw.shared_cores


def rank_rate(hw: Hardware, layout: Layout) -> float:
    """FLOP/s one rank's matmuls reach."""
    return hw.flops(layout.precision) * hw.efficiency * core_share(hw, layout)


def _local_tokens(work: Workload, layout: Layout) -> int:
    """Tokens of one micro-batch on one rank: cp splits each sequence."""
    return layout.micro_batch_size * work.seq_len // layout.cp


def tp_collectives(
    work: Workload, layout: Layout, stage: int, blocks: bool = True
) -> list[tuple[int, int, bool]]:
    """(how many, bytes of the buffer, all-reduce or not) of the tp collectives pipeline rank
    `stage` runs per micro-batch (`tensor_parallel/layers.py`, `cross_entropy.py`). Per block,
    forward: plain tp all-reduces the attention's and the MLP's row-parallel outputs (2);
    sequence parallelism all-gathers the sequence before each and reduce-scatters after (4).
    Backward: the transposes (2 all-reduces of the column-parallel inputs' gradients; 4 under sp).
    A recomputed forward runs its collectives again. The embedding sums its vocabulary shards
    (forward), the head's input is gathered (sp) and its gradient summed (backward), and the
    chunked loss (`fused_loss.py`) all-gathers, per chunk of tokens, each token's log-sum-exp over
    the rank's vocabulary slice and its target logit (fp32 (chunk, 2) from every tp rank).
    `blocks=False` leaves the blocks' own out (on hardware at hand they are timed with the block)."""
    if layout.tp == 1:
        return []
    c, sp = work.config, layout.sequence_parallel
    tokens = _local_tokens(work, layout)
    _, _, act, _ = PRECISION_BYTES[layout.precision]
    stream = tokens * c.hidden_size * act  # one (B, T, H) activation: what every block collective moves
    forward = 4 if sp else 2
    per_block = 2 * forward + (forward if layout.activation_checkpointing != "none" else 0)
    layers = stage_layers(c, layout, stage)
    out = [(layers * per_block, stream, not sp)] if blocks else []
    if stage == 0:
        out.append((1, stream, not sp))  # the embedding's partial sums (reduce-scattered under sp)
    if stage == layout.pp - 1:
        out.append((2 if sp else 1, stream, not sp))  # the head's input: gathered, gradient summed
        rows = chunk_rows(c.vocab_size // layout.tp, c.hidden_size, torch.device(work.device))
        whole, rest = divmod(tokens, rows)  # the loss's chunks: full ones, then the remainder
        out += [(n, 8 * size * layout.tp, False) for n, size in ((whole, rows), (1, rest)) if n and size]
    return out


def pipeline_messages(layout: Layout, stage: int) -> int:
    """Messages pipeline rank `stage` sends or receives per micro-batch (`pipeline/p2p.py`): each
    of its chunks receives its input and sends its input's gradient unless it is the first
    virtual stage, and sends its output and receives that output's gradient unless the last."""
    if layout.pp == 1:
        return 0
    last = layout.pp * layout.pp_virtual - 1
    chunks = [stage + c * layout.pp for c in range(layout.pp_virtual)]
    return sum(2 * (g > 0) + 2 * (g < last) for g in chunks)


def ring_block_bytes(work: Workload, layout: Layout) -> int:
    """Bytes of one exchange of ring attention (`parallel/ring_attention.py`) to the next cp rank:
    K and V of this rank's T/cp tokens and kv heads (over tp), in the compute dtype; a block's
    dK/dV sum travels in the same dtype and shape. Per layer and micro-batch the forward sends
    the K/V block cp-1 times, each posted before the step's block is computed (so overlapped
    with it); the backward sends K/V again cp-1 times and the dK/dV sums cp-1 times (home in the
    last), each overlapped with the next step's blocks but the last, whose sum is the result."""
    c = work.config
    _, _, act, _ = PRECISION_BYTES[layout.precision]
    return 2 * _local_tokens(work, layout) * c.num_key_value_heads // layout.tp * c.head_dim * act


def _ring_attention(work: Workload, layout: Layout, hw: Hardware, attention_s: float) -> float:
    """Seconds the ring adds to one block's forward + backward on one micro-batch, beyond the
    attention compute `attention_s` (its forward + backward, this rank's share) it overlaps."""
    cp = layout.cp
    if cp == 1:
        return 0.0
    link = hw.link(layout.tp * layout.pp * cp)
    send = hw.latency + ring_block_bytes(work, layout) / link  # one block sent and one received, at once
    # the forward's exchanges hide behind each step's blocks (a third of the attention work),
    # the backward's (K/V and the dK/dV sums) behind the rest; the last sum's wait is exposed
    hidden = attention_s / cp if overlaps(hw, layout) else 0.0
    forward = (cp - 1) * max(0.0, send - hidden / 3)
    backward = (2 * cp - 3) * max(0.0, send - 2 * hidden / 3) + send
    recomputed = forward if layout.activation_checkpointing != "none" else 0.0
    return forward + backward + recomputed


def elementwise_bytes(work: Workload, layout: Layout) -> float:
    """Bytes one rank's non-matmul operators move in one decoder layer and micro-batch
    (`ELEMENTWISE_BYTES`): the hidden-wide ones split tp ways only under sequence parallelism, the
    intermediate-wide ones and the weights always; ring attention's (`RING_BYTES`) besides. Sequence
    parallelism's collectives gather and scatter in place (`comm.token_chunk`): it adds no copies, and
    the dry run counts its layer at 0.96 of a tp-1 layer's bytes over tp (smollm-1.7b, tp 2,
    bf16-master; 0.88 at tp 4). Plain tp splits some hidden-wide operators too (RoPE's, the heads'),
    which this leaves whole: 1.10 of the dry run's at tp 2."""
    c, tp = work.config, layout.tp
    hidden, inter, weight = ELEMENTWISE_BYTES[layout.precision, layout.activation_checkpointing]
    width = (
        hidden * c.hidden_size / (tp if layout.sequence_parallel else 1) + inter * c.intermediate_size / tp
    )
    if layout.cp > 1:
        once, per_step = RING_BYTES
        width += (once + per_step * (layout.cp - 1)) * c.hidden_size / tp
    layer, _, _ = stage_costs(c)
    return _local_tokens(work, layout) * width + weight * layer / tp


def head_bytes(work: Workload, layout: Layout) -> float:
    """Bytes the last stage's embedding, final norm, head and loss move per micro-batch outside
    their matmuls (`HEAD_BYTES`), its vocabulary slice under tp: per logit, per chunk of tokens
    (`fused_loss.chunk_rows` on the workload's device) the d-weight update -- in bf16, the chunk's
    product read and added into the fp32 sum (an fp32 head accumulates inside its matmul) -- and per
    hidden element per token, and per weight. Held to the dry run at tp 1 and 2 (within 1.5% at tp 4);
    at pp > 1 the embedding's part sits on the first stage, not the last (not yet split here)."""
    c = work.config
    vocab, (per_logit, per_hidden, per_weight) = c.vocab_size // layout.tp, HEAD_BYTES[layout.precision]
    _, _, act, _ = PRECISION_BYTES[layout.precision]
    tokens = _local_tokens(work, layout)
    chunks = math.ceil(tokens / chunk_rows(vocab, c.hidden_size, torch.device(work.device)))
    update = 8 + act if act != 4 else 0
    return (
        tokens * (vocab * per_logit + c.hidden_size * per_hidden)
        + (chunks * update + per_weight) * vocab * c.hidden_size
    )


def micro_batch_work(work: Workload, layout: Layout, hw: Hardware, stage: int) -> float:
    """Seconds rank `stage` spends on one micro-batch (all its chunks, forward + backward)."""
    c, tp = work.config, layout.tp
    tokens = _local_tokens(work, layout)
    layer, _, head = stage_costs(c)  # matmul weights per block, and the head's
    # attention FLOPs per token per block: each of the rank's tokens attends over the sequence
    attention = attention_flops_per_token(c, work.seq_len)
    mode = layout.activation_checkpointing
    layers = stage_layers(c, layout, stage)
    last = stage == layout.pp - 1
    rate = rank_rate(hw, layout)
    if hw.profiled:
        # timed on this machine: the block at the rank's shapes (T/cp tokens of each sequence) --
        # under tp in as many ranks as share the cores in the run, with its collectives; else in
        # this process, at the rank's core share; the ring's attention over the other ranks'
        # tokens by FLOPs
        seq, batch, precision = work.seq_len // layout.cp, layout.micro_batch_size, layout.precision
        if tp == 1:
            block = block_seconds(c, batch, seq, mode, precision) / core_share(hw, layout)
        else:
            ranks = tp * max(1, min(layout.world_size, MAX_RANKS) // tp)
            block = rank_block_seconds(c, batch, seq, tp, layout.sequence_parallel, mode, precision, ranks)
            block *= core_share(hw, layout, busy=ranks) / core_share(hw, layout)  # a world past MAX_RANKS
        seconds = layers * block
        seconds += head_seconds(c, tokens, tp, precision) / core_share(hw, layout) if last else 0.0
        seconds += layers * tokens * attention * (1 - 1 / layout.cp) / tp / rate
    else:
        per_block = 6 * layer + attention
        if mode == "full":
            per_block += 2 * layer + attention / 3
        elif mode == "selective" and c.attn_implementation == "eager":
            per_block += attention / 3
        flops = layers * per_block + (6 * head if last else 0)
        # the host's fixed cost per block (operator dispatch), paid again by a recomputed forward:
        # a CPU pays it besides the compute; a GPU runs kernels while the host issues the next
        # ones, so there it is a floor (what a small block at a small micro-batch takes)
        host = layers * hw.block_overhead * (4 / 3 if mode != "none" else 1) / core_share(hw, layout)
        compute = tokens * flops / tp / rate
        # a GPU's non-matmul kernels at its memory bandwidth (a CPU's are inside its calibrated rate)
        if hw.device == "cuda":
            compute += layers * elementwise_bytes(work, layout) / hw.memory_bandwidth
            compute += head_bytes(work, layout) / hw.memory_bandwidth if last else 0.0
        seconds = max(compute, host) if hw.device == "cuda" else compute + host
    return seconds + micro_batch_communication(work, layout, hw, stage)


def micro_batch_communication(work: Workload, layout: Layout, hw: Hardware, stage: int) -> float:
    """Seconds of rank `stage`'s communication inside one micro-batch (part of `micro_batch_work`):
    its tp collectives (on hardware at hand the blocks' are timed with the block), the ring's
    exposed exchanges, its pipeline messages."""
    c, tp = work.config, layout.tp
    tokens = _local_tokens(work, layout)
    layers = stage_layers(c, layout, stage)
    attention = attention_flops_per_token(c, work.seq_len)
    seconds = 0.0
    link = hw.link(tp)
    for count, nbytes, all_reduce in tp_collectives(work, layout, stage, blocks=not hw.profiled):
        seconds += count * ring_seconds(tp, nbytes, link, hw.latency, all_reduce)
    seconds += layers * _ring_attention(work, layout, hw, tokens * attention / tp / rank_rate(hw, layout))
    _, _, _, r = PRECISION_BYTES[layout.precision]
    boundary = r * tokens * c.hidden_size // (tp if layout.sequence_parallel else 1)
    return seconds + pipeline_messages(layout, stage) * (hw.latency + boundary / hw.link(tp * layout.pp))


def step_collectives(work: Workload, layout: Layout, hw: Hardware) -> float:
    """Seconds of the gradient sums that run once per step besides dp's (`parallel/grads.py`):
    the tied embedding's two copies (first and last stage) and, under sequence parallelism, the
    norm weights' partial gradients over tp."""
    c = work.config
    _, g_bytes, _, _ = PRECISION_BYTES[layout.precision]
    seconds = 0.0
    if c.tie_word_embeddings and layout.pp > 1:
        tied = c.vocab_size * c.hidden_size // layout.tp * g_bytes
        seconds += ring_seconds(2, tied, hw.link(layout.tp * layout.pp), hw.latency)
    if layout.sequence_parallel:
        norms = (2 * c.num_hidden_layers + 1) * c.hidden_size * g_bytes // layout.pp
        seconds += ring_seconds(layout.tp, norms, hw.link(layout.tp), hw.latency)
    return seconds


def optimizer_bytes(layout: Layout, n: int, stepped: float) -> float:
    """Bytes a GPU rank's step moves after backward and before the next forward, for `n` weights of
    which it steps `stepped` (all of them, or its ZeRO-1 shard), each operator as the code runs it:
    every gradient buffer zeroed (`GradReducer.zero_grad`; ZeRO-1's shards too); the stepped
    gradients divided by dp (`data_parallel.py`: the buckets before the all-reduce, else the reduced
    shards), squared and summed for the norm in fp32 (`grads.global_norm`), scaled by the clip
    (`grads.clip_`), stepped by AdamW; under ZeRO-1 or master weights the updated shard cast to the
    weights' dtype and each bucket's gathered weights copied into the parameters (`zero.py`). For
    smollm-1.7b on 8 (dp 8) that is 60 bytes a weight at ZeRO-0, 19.5 (bf16-mixed) and 16.25
    (bf16-master) at ZeRO-1, where AdamW and the norm's read alone were 32 and 7.5: the dry run's
    roofline counts 64, 20.0 and 16.7 (AdamW's schema says it writes the gradients too: 32 bytes)."""
    w, g, _, _ = PRECISION_BYTES[layout.precision]
    replicas = layout.replicas
    zero = layout.zero_shards or layout.precision == "bf16-master"  # a `ZeroOptimizer` steps
    squares = (0 if g == 4 else g + 4) + 4 + 4 + 4  # to fp32, squared (read, written), summed
    per_stepped = ADAMW_BYTES_PER_ELEMENT + squares + 2 * g  # + the clip's scaling in place
    per_weight = g  # zeroed
    if replicas > 1:
        per_stepped += 2 * g  # divided in place by dp
    if zero:
        per_stepped += g if layout.zero_shards else 0  # the reduced shard zeroed
        if replicas > 1:  # the (fp32 master's) shard cast to the weights' dtype, the bucket copied in
            per_stepped += 4 + w if layout.precision == "bf16-master" else 0
            per_weight += 2 * w
        else:  # bf16-master over one replica: the master is the bucket, copied into the parameters, cast
            per_weight += 4 + w
    return per_stepped * stepped + per_weight * n


def _pipeline(works: list[float], layout: Layout, hw: Hardware) -> tuple[float, float]:
    """(compute, bubble) seconds of a step whose pipeline ranks spend `works[stage]` seconds per
    micro-batch: the busiest stage's m micro-batches, stretched by the schedule's bubble."""
    p, m = layout.pp, layout.accumulate_grad_batches
    busiest, idle = m * max(works), bubble_fraction(m, p, layout.pp_virtual)
    # in the bubble one stage's ranks compute: on shared cores they have the idle ones' share too
    alone = core_share(hw, layout) / core_share(hw, layout, busy=layout.world_size // p)
    if p == 1 or not hw.shared_cores or layout.world_size <= hw.shared_cores:
        return busiest, busiest * idle / (1 - idle) * alone
    # more ranks than cores: a rank that waits for its pipeline peer gives its core to a busy one,
    # and the cores never idle -- every rank's work shared out over them, unless the busiest
    # stage, its cores to itself, is the longer path
    pooled, critical = m * sum(works) / p, busiest * alone / (1 - idle)
    return (pooled, 0.0) if pooled >= critical else (busiest * alone, critical - busiest * alone)


def step_time(work: Workload, layout: Layout, hw: Hardware) -> dict[str, float]:
    """Seconds of one optimizer step, as parts, and their `total`."""
    p = layout.pp
    replicas = layout.dp * layout.cp  # the ranks holding the same weights: gradients reduce here
    w_bytes, g_bytes, _, r = PRECISION_BYTES[layout.precision]
    works = [micro_batch_work(work, layout, hw, s) for s in range(p)]
    compute, bubble = _pipeline(works, layout, hw)
    tokens = _local_tokens(work, layout)
    boundary = tokens * work.config.hidden_size * r / (layout.tp if layout.sequence_parallel else 1)
    fill = (p - 1) * boundary / hw.link(layout.tp * p) if p > 1 else 0.0
    n = max(rank_parameters(work.config, layout, s) for s in range(p))
    dp_link = hw.link(layout.world_size)
    buckets = max(1, math.ceil(n * g_bytes / work.bucket_bytes))
    latencies = (buckets - 1) * hw.latency if replicas > 1 else 0.0  # ring_seconds charges one
    if layout.zero_stage == 1:
        reduce = ring_seconds(replicas, n * g_bytes, dp_link, hw.latency, all_reduce=False) + latencies
        gather = ring_seconds(replicas, n * w_bytes, dp_link, hw.latency, all_reduce=False)
        stepped = n / replicas
    else:
        reduce, gather, stepped = ring_seconds(replicas, n * g_bytes, dp_link, hw.latency) + latencies, 0.0, n
    # the buckets' window: the last micro-batch's backward, where communication can overlap
    last_backward = max(works) * 2 / 3 if overlaps(hw, layout) else 0.0
    last_bucket = min(work.bucket_bytes, n * g_bytes) / (n * g_bytes) * reduce  # launched after backward
    exposed = max(reduce - last_backward, last_bucket) if reduce else 0.0
    if hw.device == "cuda":
        optimizer = optimizer_bytes(layout, n, stepped) / hw.memory_bandwidth
    else:  # a CPU's: AdamW and the norm's read (its foreach kernels are not a GPU's)
        optimizer = (ADAMW_BYTES_PER_ELEMENT * stepped + n * g_bytes) / hw.memory_bandwidth
    parts = {
        "compute": compute,
        "bubble": bubble,
        "pipeline_fill": fill,
        "step_collectives": step_collectives(work, layout, hw),
        "dp_reduce_exposed": exposed,
        "zero_all_gather": gather,
        "optimizer": optimizer,
    }
    parts["total"] = sum(parts.values())
    return parts
