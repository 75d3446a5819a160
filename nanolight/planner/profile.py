"""Compute measured where it runs: on hardware at hand (this machine's CPU), one decoder block's
forward + backward and the output head with its loss, timed at the workload's shapes.

Why measure rather than count FLOPs: on a CPU a tiny model's step is not its matmuls. At hidden
128 (bench_planner's model) the matmuls are 45% of a step; attention runs at a third of the
matmul rate, and the elementwise ops (norms, RoPE, SiLU, residual adds, their gradients) and the
host's per-operator cost take the rest, in proportions that change with every width. A FLOP
count at the matmul rate predicted 0.14 s for a 0.30 s step, and it got the layouts' order wrong
where it matters: tensor parallelism splits the matmuls but not the norms and residual adds of the
replicated hidden stream, and recompute re-runs the elementwise ops too. Profiling each layer once
per shape is what planners for hardware at hand do (Alpa's stage profiling, Galvatron's profiler);
a datasheet GPU keeps the FLOP count at a published efficiency (`timing.micro_batch_work`).

The probe is the model's own code: a `DecoderLayer` of the rank's shard (heads, kv heads and
intermediate width over tp; the hidden stream whole, as tensor parallelism leaves it) under the
layout's recompute mode (`parallel/blocks.py`), on one thread as a gloo rank runs, in the layout's
compute dtype. What it leaves to the time model: the tp collectives (counted in `timing`), and
sequence parallelism's split of the norms over tp (a small share, not subtracted).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch
from torch import nn

from nanolight.models.fused_loss import linear_cross_entropy
from nanolight.models.llama import DecoderLayer, LlamaConfig
from nanolight.models.llama_rope import rope_cos_sin, rope_inv_freq
from nanolight.parallel.blocks import apply_activation_checkpointing

REPEATS = 10  # timed runs per probe at most; the fastest counts (other processes' load only ever adds time)
BUDGET_S = 0.5  # ... and no more runs once the timed ones took this long (a large block: two runs)

_measured: dict[tuple, float] = {}  # probes are kept: a search asks for the same few shapes many times


class _OneBlock(nn.Module):
    """One decoder block where `parallel/blocks.py` looks for a model's blocks (``pp_plan``)."""

    pp_plan = {"layers": "layers"}

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList([DecoderLayer(config)])


def clear() -> None:
    """Forget the kept probes (a benchmark re-measures after re-calibrating)."""
    _measured.clear()


def _seconds(run: Callable[[], object]) -> float:
    """The fastest of up to `REPEATS` timed runs of `run()` on one thread (at least two, then
    until `BUDGET_S` is spent), after a warm-up run."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run()
        times: list[float] = []
        while len(times) < REPEATS and (len(times) < 2 or sum(times) < BUDGET_S):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return min(times)
    finally:
        torch.set_num_threads(threads)


def _autocast(precision: str) -> torch.autocast:
    """The compute dtype of a precision mode on the CPU: fp32 for 32-true, bf16 otherwise."""
    return torch.autocast("cpu", torch.bfloat16, enabled=precision != "32-true")


def _shard(config: LlamaConfig, tp: int) -> LlamaConfig:
    """The config of one tp rank's block: heads, kv heads (replicated when fewer than tp) and the
    MLP's width split, the hidden size whole."""
    return dataclasses.replace(
        config,
        num_attention_heads=config.num_attention_heads // tp,
        num_key_value_heads=max(1, config.num_key_value_heads // tp),
        intermediate_size=config.intermediate_size // tp,
        head_dim=config.head_dim,
        num_hidden_layers=1,
    )


def block_seconds(config: LlamaConfig, batch: int, seq_len: int, tp: int, mode: str, precision: str) -> float:
    """Seconds of one block's forward + backward (with its recompute under `mode`) on `batch`
    sequences of `seq_len` tokens, one tp rank's shard."""
    key = ("block", repr(config), batch, seq_len, tp, mode, precision)
    if key not in _measured:
        torch.manual_seed(0)
        holder = _OneBlock(_shard(config, tp))
        apply_activation_checkpointing(holder, mode)
        block = holder.layers[0]
        x = torch.randn(batch, seq_len, config.hidden_size, requires_grad=True)
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        positions = torch.arange(seq_len).expand(batch, seq_len)

        def run() -> None:
            with _autocast(precision):
                cos, sin = rope_cos_sin(positions, inv_freq, x.dtype)
                y = block(x, cos, sin)
            y.backward(torch.ones_like(y))

        _measured[key] = _seconds(run)
    return _measured[key]


def head_seconds(config: LlamaConfig, tokens: int, tp: int, precision: str) -> float:
    """Seconds of the output head and the loss, forward + backward, on `tokens` tokens: the
    vocabulary's shard over tp."""
    key = ("head", config.hidden_size, config.vocab_size, tokens, tp, precision)
    if key not in _measured:
        torch.manual_seed(0)
        hidden = torch.randn(tokens, config.hidden_size, requires_grad=True)
        weight = nn.Parameter(torch.randn(config.vocab_size // tp, config.hidden_size) * 0.02)
        labels = torch.randint(0, weight.shape[0], (tokens,))

        def run() -> None:
            with _autocast(precision):
                loss = linear_cross_entropy(hidden, weight, labels)
            loss.backward()

        _measured[key] = _seconds(run)
    return _measured[key]
