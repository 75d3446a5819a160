"""Peak memory of one rank under a `Layout`, as parts, derived from what the code allocates.

Every figure here is read off the code that holds the memory, so a change there shows up as a
failing comparison in `tests/test_planner_memory.py` (predicted vs measured on real runs):

parameters      this rank's slice: decoder blocks split by the pipeline (`pipeline/split.py`, the
                busiest rank), matrices split by tp (norm weights are replicated), the embedding on
                the first stage and the head on the last (a tied embedding is kept on both ends).
gradients       one per parameter, in the gradient dtype (`data_parallel.py` buckets under dp: the
                padding to dp slices is a few elements); ZeRO-1 adds this rank's reduced shard,
                1/(dp*cp) (the replicas: cp ranks hold the same weights).
optimizer_state AdamW's two moments per parameter; ZeRO-1 (`zero.py`) keeps 1/(dp*cp) of them and of
                the fp32 master weights (fp32 whatever the parameter dtype); bf16-master keeps the
                fp32 master copy on every rank without ZeRO. ZeRO-1 over one replica is no ZeRO
                (`Parallel3DStrategy.setup_optimizers`: nothing to shard).
activations     what autograd saves per decoder block (`block_activation_bytes`, op by op below;
                under bf16-mixed also autocast's bf16 copy of each matmul weight: `autocast_weight_bytes`),
                times the chunk activations the schedule keeps alive at its peak (walking
                `stage_schedule` itself), plus the first stage's token ids and the last stage's
                norm and loss.
communication   pipeline sends: a sent activation is the chunk's output, alive until that
                micro-batch's backward (the schedule's in-flight outputs); a sent gradient is
                held until its batch is complete: at most two, counted from the stage's
                program (`schedules.held_sends`).
transient       what lives only for a moment at the peak: under recompute, one block's backward
                (`recompute_transient_bytes`: its activations rebuilt, its gradients in flight, the
                head's already gone); ring attention's (cp > 1) buffers of one block's
                backward (`ring_transient_bytes`); the fused head + loss at the forward's end
                (`head_transient_bytes`); while activations are gone, the embedding's gradient
                at the end of backward (`embedding_grad_bytes`) and after backward ZeRO-1's
                all-gather buffers (a full bucket per bucket, in the parameter dtype).
allocator       CUDA caching-allocator slack (fragmentation, rounding): a fixed allowance on GPUs,
                to be checked against `torch.cuda.max_memory_allocated` when a GPU is at hand.

The block's saved tensors (fp32 units: x = tokens on this rank between tp regions, N = tokens
of the micro-batch, q/kv = query/key-value widths, I = MLP width, all / tp where tp splits them):
norm inputs x*h and rstd x (twice), the two column linears' gathered inputs N*h, rope'd q and k
and v copied out of the qkv output (`rope_qkv`: the output itself is not kept), SDPA's output and
log-sum-exp, gate_up (2I), silu (I) and the product (I); eager attention instead saves q, the
GQA-expanded k and v, the (T, T) mask and the softmax (b, heads, T, T). The head: the fused head +
loss (`fused_loss.py`, over this rank's vocabulary slice under tp) keeps d hidden (the whole
sequence's: the head's input is gathered) and an fp32 d weight. `full` recompute keeps the block
input only; `selective` keeps the input, the matmul outputs and the attention kernel's outputs
(`blocks._keep`; under ring attention every block kernel's: `ring_kernel_output_bytes`).

Context parallelism (cp > 1) gives each rank T/cp tokens of every sequence (zigzag chunks), so
every per-token term above scales by 1/cp; ring attention (`parallel/ring_attention.py`, whatever
`attn_implementation`) saves q, k, v, its fp32 output accumulator and fp32 log-sum-exp, and
returns the output cast to the compute dtype (the same tensor in fp32).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, lru_cache

import torch

from nanolight.models.fused_loss import chunk_rows
from nanolight.models.llama_config import LlamaConfig, stage_costs
from nanolight.parallel.data_parallel import DEFAULT_BUCKET_BYTES
from nanolight.parallel.pipeline.schedules import FORWARD, held_sends, stage_program, stage_schedule
from nanolight.parallel.pipeline.split import balanced_layer_split
from nanolight.planner.layout import PRECISION_BYTES, Layout

ALLOCATOR_MARGIN = {"cuda": 0.08, "cpu": 0.0}  # of the rest: an allowance, not measured (no GPU here)
PARTS = (
    "parameters",
    "gradients",
    "optimizer_state",
    "activations",
    "communication",
    "transient",
    "allocator",
)


@dataclass(frozen=True)
class Workload:
    """The model and one sequence's length; `device` picks CPU- or GPU-only kernels; the dp
    reduction's bucket size is the code's (`data_parallel.py`)."""

    config: LlamaConfig
    seq_len: int
    device: str = "cuda"
    bucket_bytes: int = DEFAULT_BUCKET_BYTES


def chunk_layers(config: LlamaConfig, layout: Layout) -> list[list[range]]:
    """Per pipeline rank, the decoder layers of each of its chunks (the split the code makes)."""
    return _chunk_layers(config.num_hidden_layers, stage_costs(config), layout.pp, layout.pp_virtual)


def stage_layers(config: LlamaConfig, layout: Layout, stage: int) -> int:
    """Decoder layers pipeline rank `stage` holds, over all its chunks."""
    return sum(len(r) for r in chunk_layers(config, layout)[stage])


@cache
def _chunk_layers(layers: int, costs: tuple[float, float, float], p: int, v: int) -> list[list[range]]:
    if p == 1:
        return [[range(layers)]]
    ranges = balanced_layer_split(layers, p * v, *costs)
    return [[ranges[r + c * p] for c in range(v)] for r in range(p)]


@lru_cache(maxsize=4096)
def _sent_alive(name: str, m: int, p: int, stage: int, v: int) -> int:
    """Sent tensors (activations, gradients) alive at once, running the stage's program
    (`schedules.held_sends`)."""
    return held_sends(stage_program(name, m, p, stage, v), p, stage, v)[2] if m > 0 else 0


@lru_cache(maxsize=4096)
def _schedule(name: str, m: int, p: int, stage: int, v: int) -> tuple:
    """The stage's chunk-level list, kept: the planner walks the same few thousand times."""
    return tuple(stage_schedule(name, m, p, stage, v))


def rank_parameters(config: LlamaConfig, layout: Layout, stage: int) -> int:
    """Parameters (elements) held by a rank of pipeline stage `stage`."""
    c, tp = config, layout.tp
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    block = (c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size) // tp
    block += 2 * c.hidden_size  # the two norms, replicated over tp
    layers = stage_layers(config, layout, stage)
    vocab = c.vocab_size * c.hidden_size // tp
    first, last = stage == 0, stage == layout.pp - 1
    n = layers * block
    n += vocab if first else 0
    if last:
        n += c.hidden_size  # final norm
        n += vocab if (not c.tie_word_embeddings or layout.pp > 1) else 0  # head, or the tied copy
    return n


def rank_tokens(layout: Layout, seq_len: int) -> tuple[int, int]:
    """(N, x): a micro-batch's tokens on this rank (its 1/cp of each sequence), and those between
    tp regions (1/tp of them under sequence parallelism)."""
    N = layout.micro_batch_size * seq_len // layout.cp
    return N, N // layout.tp if layout.sequence_parallel else N


def block_activation_bytes(work: Workload, layout: Layout, mode: str | None = None) -> int:
    """Bytes autograd saves for one decoder block and one micro-batch (see the module docstring)."""
    c, tp = work.config, layout.tp
    _, _, a, r = PRECISION_BYTES[layout.precision]
    (N, x), h = rank_tokens(layout, work.seq_len), c.hidden_size
    q, kv = c.num_attention_heads * c.head_dim // tp, c.num_key_value_heads * c.head_dim // tp
    inter = c.intermediate_size // tp
    mode = mode or layout.activation_checkpointing
    block_input = r * x * h
    if mode == "full":
        return block_input
    attention, kernel_outputs, _ = attention_bytes(work, layout)
    if mode == "selective":  # block input + matmul outputs (qkv, o, gate_up, down) + attention kernel's
        matmuls = a * N * (q + 2 * kv) + 2 * a * N * h + a * N * 2 * inter
        return block_input + matmuls + kernel_outputs + autocast_weight_bytes(c, layout)
    norms = 2 * (r * x * h + 4 * x)
    linear_inputs = 2 * a * N * h
    mlp = a * N * 2 * inter + 2 * a * N * inter
    return norms + linear_inputs + attention + mlp + autocast_weight_bytes(c, layout)


def attention_bytes(work: Workload, layout: Layout) -> tuple[int, int, int]:
    """One block's attention: (what it saves, what `selective` keeps of it, what its kernel's
    backward makes besides the input gradients). Ring attention (cp > 1) saves q, k, v, the fp32
    output and lse and the output's cast; its backward's buffers are `ring_transient_bytes`.
    Eager saves q, the GQA-expanded k and v, the (T, T) mask and the probabilities, and its
    backward makes their gradient and the scores' (b, heads, T, T each). The fused kernel saves q,
    k, v, its output and lse."""
    c, tp, b, T = work.config, layout.tp, layout.micro_batch_size, work.seq_len // layout.cp
    a = PRECISION_BYTES[layout.precision][2]
    N = b * T
    q, kv = c.num_attention_heads * c.head_dim // tp, c.num_key_value_heads * c.head_dim // tp
    heads = c.num_attention_heads // tp
    if layout.cp > 1:
        attn_out = a * N * q if a != 4 else 0
        saved = a * N * (q + 2 * kv) + 4 * N * q + 4 * b * heads * T + attn_out
        return saved, ring_kernel_output_bytes(work, layout), 0
    attn_out = a * N * q
    if c.attn_implementation == "eager":  # eager's matmuls are bmm: recomputed under `selective`
        return a * N * q * 3 + T * T + a * b * heads * T * T + attn_out, 0, 2 * a * b * heads * T * T
    return a * N * (q + 2 * kv) + 4 * b * heads * T + attn_out, attn_out + 4 * b * heads * T, 0


def ring_kernel_output_bytes(work: Workload, layout: Layout) -> int:
    """What `selective` keeps of one block's ring attention (cp > 1): the outputs of every block
    kernel the ring calls (`blocks._keep` saves each call of the fused kernel), not the merged
    fp32 output and lse the ring saves for its backward, which the recompute rebuilds from them.
    A rank's two zigzag chunks of c = T/2 queries each meet every key chunk at or before them:
    2*cp + 1 blocks per micro-batch (`RingAttention.pairs`), each a (b, heads, c, D) output in
    the compute dtype and a (b, heads, c) fp32 lse. Counted as one fp32 output and lse, the 8B at
    cp 4 read 4.5% under the dry run (tp 4, sp, dp 4, mbs 1; 0.9% under since)."""
    c, tp, b = work.config, layout.tp, layout.micro_batch_size
    a = PRECISION_BYTES[layout.precision][2]
    rows = b * (work.seq_len // layout.cp // 2)  # one chunk's queries
    q, heads = c.num_attention_heads * c.head_dim // tp, c.num_attention_heads // tp
    return (2 * layout.cp + 1) * (a * rows * q + 4 * rows * heads)


def autocast_weight_bytes(config: LlamaConfig, layout: Layout) -> int:
    """Under bf16-mixed, autocast casts each fp32 matmul weight of a block to bf16 in the forward,
    and the matmul saves that copy for its backward: one copy per micro-batch in flight (each
    forward's autocast region casts anew). Measured by the dry run at smollm-1.7b and the 8B (tp 4):
    without it the planner was 7-8% under there, and only at bf16-mixed."""
    if layout.precision != "bf16-mixed":
        return 0
    return 2 * int(stage_costs(config)[0]) // layout.tp


def ring_transient_bytes(work: Workload, layout: Layout) -> int:
    """Bytes ring attention (cp > 1) holds beyond the saved activations during one block's
    backward, its busiest moment (`_RingAttention.backward`): dq and the expanded dk, dv (fp32,
    q's heads), this rank's own block's dK/dV share and the step's accumulator (fp32, kv heads),
    the sum sent on and the one arriving (compute dtype), the stacked K/V and the block arriving
    (compute dtype), and K/V expanded to q's heads under GQA.
    The forward holds less: its output and lse accumulators are saved activations."""
    if layout.cp == 1:
        return 0
    c, tp = work.config, layout.tp
    _, _, a, _ = PRECISION_BYTES[layout.precision]
    N = layout.micro_batch_size * work.seq_len // layout.cp
    q, kv = c.num_attention_heads * c.head_dim // tp, c.num_key_value_heads * c.head_dim // tp
    expanded = 2 * a * N * q if q != kv else 0
    return 3 * 4 * N * q + 2 * (2 * 4 * N * kv) + 4 * (2 * a * N * kv) + expanded


def chunk_activation_bytes(work: Workload, layout: Layout, stage: int) -> list[int]:
    """Bytes saved by one micro-batch's forward through each of this rank's chunks."""
    c, p, v = work.config, layout.pp, layout.pp_virtual
    r = PRECISION_BYTES[layout.precision][3]
    T = work.seq_len // layout.cp  # this rank's tokens of each sequence
    N, h, tp = layout.micro_batch_size * T, c.hidden_size, layout.tp
    block = block_activation_bytes(work, layout)
    out = []
    for ci, layers in enumerate(chunk_layers(c, layout)[stage]):
        g = stage + ci * p  # global virtual stage
        n = len(layers) * block + 2 * r * T * c.head_dim  # + this forward's rope cos, sin tables
        if g == 0:
            n += 8 * N  # token ids (int64), saved by the embedding
        if g == p * v - 1:
            n += head_saved_bytes(work, layout) + 4 * c.vocab_size // tp * h  # and the fp32 d weight
        out.append(n)
    return out


def head_saved_bytes(work: Workload, layout: Layout) -> int:
    """What the last stage's final norm (input, rstd) and fused head + loss (the d hidden) save
    per micro-batch, released by the head's backward. (The head's fp32 d weight is not counted
    here: a tied head's gradient is held until the embedding's backward.)"""
    r = PRECISION_BYTES[layout.precision][3]
    N, x = rank_tokens(layout, work.seq_len)
    return r * x * work.config.hidden_size + 4 * x + r * N * work.config.hidden_size


def recompute_transient_bytes(work: Workload, layout: Layout, stage: int) -> int:
    """What a recomputed block's backward holds beyond the saved activations the schedule counts
    (`activation_checkpointing` full or selective; 0 otherwise), at the busier of two moments.
    The MLP's backward, the block's first: `_SwiGLU.backward` making d gate_up (2I) while holding
    the incoming d product (I) and the block's output gradient (x*h), with every tensor the
    recompute rebuilt but the product down_proj's backward consumed. The attention's backward:
    the MLP's and the second norm's tensors gone, the block input, rstd, qkv's input and the
    attention's saved tensors held, with the output gradient, d attention output and what the
    kernel's backward makes (eager's (T, T) gradients; the ring's buffers, `ring_transient_bytes`).
    The input norm's input is the block input the checkpoint keeps (one tensor). Under `selective`
    the rebuilt block's qkv and o_proj outputs were consumed by the recompute, while down_proj's
    output stays in the checkpoint's cache until the block's backward ends: the recompute stops
    at its last saved tensor, before that matmul. On the last stage the head's saved tensors are
    gone by then (`head_saved_bytes`; interleaved too: the dry run's pp 2 v 2 peak is a backward
    of the last chunk). Held to the dry run where this is the peak (`tests/test_dry_run.py`); one
    block's activations rebuilt on top of everything read +9.6% (selective), -13.5% (full) there."""
    mode = layout.activation_checkpointing
    if mode == "none":
        return 0
    c, tp = work.config, layout.tp
    _, _, a, r = PRECISION_BYTES[layout.precision]
    N, x = rank_tokens(layout, work.seq_len)
    h, q, inter = c.hidden_size, c.num_attention_heads * c.head_dim // tp, c.intermediate_size // tp
    cached = a * N * h if mode == "selective" else 0  # down_proj's output
    # the rebuilt tensors but the product, with d product and d gate_up
    mlp = block_activation_bytes(work, layout, "none") - a * N * inter + 3 * a * N * inter
    # the block input, rstd, qkv's input, the attention's saved tensors, d attention output
    saved, _, kernel_gradients = attention_bytes(work, layout)
    attention = r * x * h + 4 * x + a * N * h + saved + a * N * q + kernel_gradients
    attention += ring_transient_bytes(work, layout)
    released = head_saved_bytes(work, layout) if stage == layout.pp - 1 else 0
    kept = block_activation_bytes(work, layout)
    return max(mlp, attention) + cached + r * x * h - kept - released  # + the block output's gradient


def schedule_peaks(work: Workload, layout: Layout, stage: int) -> tuple[int, int]:
    """(peak saved activations, peak pipeline send bytes held) for rank `stage`,
    walking the stage's own schedule."""
    p, v, m = layout.pp, layout.pp_virtual, layout.accumulate_grad_batches
    chunks = chunk_activation_bytes(work, layout, stage)
    if p == 1:
        return chunks[0], 0
    _, _, _, r = PRECISION_BYTES[layout.precision]
    tokens = layout.micro_batch_size * work.seq_len // layout.cp
    boundary = r * (tokens // layout.tp if layout.sequence_parallel else tokens) * work.config.hidden_size
    live = peak = 0
    for kind, _, c in _schedule(layout.pp_schedule, m, p, stage, v):
        live += chunks[c] if kind == FORWARD else -chunks[c]
        peak = max(peak, live)
    # A sent activation is the chunk's output, kept until that chunk's backward (and until its
    # batch is complete); a sent gradient until its batch is complete: the stage's program says
    # how many of them are alive at once, exactly (`held_sends`).
    return peak, _sent_alive(layout.pp_schedule, m, p, stage, v) * boundary


def head_transient_bytes(work: Workload, layout: Layout, stage: int) -> int:
    """What the fused head + loss (`fused_loss.py`, over this rank's vocabulary slice under tp) holds
    beyond the saved activations at the end of the last stage's forward, every block's activations
    still held, the fp32 d weight among them (`chunk_activation_bytes`). Its busiest moment is a
    chunk's d weight update (the last chunk's buffers are dropped before a chunk's are made): the
    chunk's fp32 logits, turned in place into the softmax minus the one-hot, and under bf16 compute
    their bf16 copy (the matmul's input) and the bf16 (V, H) product added into the fp32 d weight.
    The chunk's earlier moments hold less: its bf16 logits and their fp32 copy, the d weight
    untouched. Under bf16-mixed the head's fp32 weight is cast to bf16 for the whole loss. A
    chunk's per-token statistics (tokens x 2, from every tp rank) and its slice of the hidden
    states are small next to its logits."""
    if stage != layout.pp - 1:
        return 0
    c = work.config
    vocab, h = c.vocab_size // layout.tp, c.hidden_size
    rows = chunk_rows(vocab, h, torch.device(work.device))
    tokens = layout.micro_batch_size * work.seq_len // layout.cp
    w, _, a, _ = PRECISION_BYTES[layout.precision]
    low = a if a != 4 else 0  # bf16 compute
    update = (4 + low) * min(rows, tokens) * vocab + low * vocab * h
    weight_cast = a * vocab * h if w != a else 0
    return update + weight_cast


def embedding_grad_bytes(work: Workload, layout: Layout, stage: int) -> int:
    """The end of the first stage's backward, its activations gone: the embedding's gradient, dense
    (vocab/tp x hidden, in the weight's dtype) until it is added into its bucket; a tied embedding
    on one stage (pp 1) also holds the head's gradient, which autograd keeps for it, and their sum."""
    if stage != 0:
        return 0
    c = work.config
    grad = PRECISION_BYTES[layout.precision][0] * (c.vocab_size // layout.tp) * c.hidden_size
    return 3 * grad if c.tie_word_embeddings and layout.pp == 1 else grad


def rank_memory(work: Workload, layout: Layout, stage: int) -> dict[str, int]:
    """The parts (bytes) of pipeline stage `stage`'s ranks, and their `total`."""
    w_bytes, g_bytes, _, _ = PRECISION_BYTES[layout.precision]
    n = rank_parameters(work.config, layout, stage)
    # ZeRO-1 shards over the replicas, dp x cp; over one the strategy steps the plain optimizer
    # (bf16-master: a one-rank ZeRO optimizer, its gradient shard the buckets themselves)
    dp = layout.replicas
    grads = n * g_bytes + (n // dp * g_bytes if layout.zero_shards else 0)
    if layout.zero_shards:
        optimizer = 12 * n // dp  # fp32 master + two fp32 moments, 1/(dp*cp) of each
    elif layout.precision == "bf16-master":
        optimizer = 12 * n
    else:
        optimizer = 2 * n * w_bytes
    activations, sent = schedule_peaks(work, layout, stage)
    # one block's backward: what a recomputed one holds (the ring's buffers among it), or the ring's
    if layout.activation_checkpointing != "none":
        backward = recompute_transient_bytes(work, layout, stage)
    else:
        backward = ring_transient_bytes(work, layout)
    backward = max(backward, head_transient_bytes(work, layout, stage))  # the forward's last moment
    gather = n * w_bytes if layout.zero_shards else 0  # after backward: no activations then
    backward_end = embedding_grad_bytes(work, layout, stage)  # nor then
    parts = {
        "parameters": n * w_bytes,
        "gradients": grads,
        "optimizer_state": optimizer,
        "activations": activations,
        "communication": sent,
        "transient": max(backward, max(gather, backward_end) - activations - sent),
    }
    parts["allocator"] = int(ALLOCATOR_MARGIN.get(work.device, 0.0) * sum(parts.values()))
    parts["total"] = sum(parts.values())
    return parts


def peak_memory(work: Workload, layout: Layout) -> dict[str, int]:
    """The most loaded rank's parts (pipeline stages differ; tp, cp and dp ranks are alike)."""
    return max((rank_memory(work, layout, s) for s in range(layout.pp)), key=lambda parts: parts["total"])
