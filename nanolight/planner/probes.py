"""Compute timed where it runs: on hardware at hand (this machine's CPU), a decoder block's forward
+ backward and the output head with its loss, timed at a workload's shapes.

Why measure rather than count FLOPs: on a CPU a tiny model's step is not its matmuls. At hidden
128 (bench_planner's model) the matmuls are 45% of a step; attention runs at a third of the
matmul rate, and the elementwise ops (norms, RoPE, SiLU, residual adds, their gradients) and the
host's per-operator cost take the rest, in proportions that change with every width. A FLOP
count at the matmul rate predicted 0.14 s for a 0.30 s step, and it got the layouts' order wrong
where it matters: tensor parallelism splits the matmuls but not the norms and residual adds of the
replicated hidden stream, and recompute re-runs the elementwise ops too. Profiling each layer once
per shape is what planners for hardware at hand do (Alpa's stage profiling, Galvatron's profiler);
a datasheet GPU keeps the FLOP count at a published efficiency (`timing.micro_batch_work`).

The probes are the model's own code under the layout's recompute mode (`parallel/blocks.py`), on
one thread as a gloo rank runs, in the layout's compute dtype:

- `block_seconds`: one `DecoderLayer`, in this process (on a GPU at hand, a tiny one times the
  host's cost of issuing a block's kernels: `hardware.at_hand`).
- `rank_block_seconds`: the block in forked gloo ranks computing at once, as many as the
  layout has on this machine (up to `MAX_RANKS`), tensor-parallel (`apply_tensor_parallel`,
  sequence parallelism too) with its collectives when tp > 1 (`timing` asks for it under tp only).
  A tp block is not its shard's compute plus the collectives' latency: between busy ranks each
  collective waits for the slower rank, and that wait grows with the work before it. Measured
  here (bench_planner's model, tp=2): the shard alone 16 ms, the real block 26-39 ms, about
  2.5-6 ms per collective where an idle one costs 0.15 ms. So the runs' median counts, not the
  fastest (`RANK_PICK`): the wait is paid at every collective of a training run, and the fastest
  probe run is the one whose ranks happened to stay in step. In bench_planner the fastest put
  the tp layouts at 0.64-0.73 of their measured step, the median at 0.89-1.03.
  The ranks stay up for a search (`_Ranks`: a group's set-up costs more than a probe).
- `head_seconds`: the vocabulary's tp shard of the head and the fused loss, in this process (its
  collectives are counted by `timing`).
"""

from __future__ import annotations

import atexit
import queue
import socket
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nanolight.models.fused_loss import linear_cross_entropy
from nanolight.models.llama import DecoderLayer, LlamaConfig, LlamaForCausalLM
from nanolight.models.llama_rope import rope_cos_sin, rope_inv_freq
from nanolight.parallel.blocks import apply_activation_checkpointing
from nanolight.parallel.context import ParallelContext
from nanolight.parallel.tensor_parallel.apply import apply_tensor_parallel

REPEATS = 10  # timed runs per probe at most; in this process the fastest counts (load only ever adds time)
BUDGET_S = 0.5  # ... and no more runs once the timed ones took this long (a large block: two runs)
MAX_RANKS = 8  # forked ranks of a block probe at most; a larger world's contention is scaled (`timing`)
# the run of a block in ranks that counts: the median -- a collective's wait for the slower rank
# is paid at every collective of a run, not noise that only ever adds time
RANK_PICK: Callable[[list[float]], float] = statistics.median
WAIT_S = 300  # a probe in ranks that has not answered by then has hung (a rank died in a collective)

# the model's tp plan for one block, as `_OneBlock` names its modules ("layers.0.mlp.down_proj")
BLOCK_TP_PLAN = {
    name.removeprefix("model."): style
    for name, style in LlamaForCausalLM.tp_plan.items()
    if name.startswith("model.layers.")
}

CPU = torch.device("cpu")
_measured: dict[tuple, float] = {}  # probes are kept: a search asks for the same few shapes many times


@contextmanager
def one_thread() -> Iterator[None]:
    """Measure as a gloo test rank runs (one thread), then give the caller its threads back."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def free_port() -> int:
    """A local TCP port nobody listens on now, for a short-lived gloo group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _OneBlock(nn.Module):
    """One decoder block where `parallel/blocks.py` and the tp plan look for a model's blocks."""

    pp_plan = {"layers": "layers"}

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList([DecoderLayer(replace(config, num_hidden_layers=1))])


def _autocast(precision: str, device: torch.device = CPU) -> torch.autocast:
    """The compute dtype of a precision mode: fp32 for 32-true, bf16 otherwise."""
    return torch.autocast(device.type, torch.bfloat16, enabled=precision != "32-true")


def _block_run(
    block: nn.Module,
    config: LlamaConfig,
    batch: int,
    seq_len: int,
    local: int,
    precision: str,
    device: torch.device = CPU,
) -> Callable[[], None]:
    """One forward + backward of `block` (on `device`) on `batch` sequences of `seq_len` positions,
    of which the block's input holds `local` (all, or 1/tp under sequence parallelism). On a GPU
    the run ends when its kernels have."""
    x = torch.randn(batch, local, config.hidden_size, device=device, requires_grad=True)
    inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling).to(device)
    positions = torch.arange(seq_len, device=device).expand(batch, seq_len)

    def run() -> None:
        with _autocast(precision, device):
            cos, sin = rope_cos_sin(positions, inv_freq, x.dtype)
            y = block(x, cos, sin)
        y.backward(torch.ones_like(y))
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return run


def _timed(
    run: Callable[[], object],
    agree: Callable[[float], float] = float,
    pick: Callable[[list[float]], float] = min,
) -> float:
    """The fastest (or what `pick` picks) of up to `REPEATS` timed runs of `run()` on one thread
    (at least two, then until `BUDGET_S` is spent), after a warm-up run. `agree` turns a run's
    seconds into the figure that counts (for ranks: the slowest rank's, so that all of them time
    the same number of runs)."""
    with one_thread():
        run()
        times: list[float] = []
        while len(times) < REPEATS and (len(times) < 2 or sum(times) < BUDGET_S):
            start = time.perf_counter()
            run()
            times.append(agree(time.perf_counter() - start))
        return pick(times)


def block_seconds(
    config: LlamaConfig, batch: int, seq_len: int, mode: str, precision: str, device: torch.device = CPU
) -> float:
    """Seconds of one block's forward + backward (with its recompute under `mode`) on `batch`
    sequences of `seq_len` tokens, in this process, on `device`."""
    key = ("block", repr(config), batch, seq_len, mode, precision, str(device))
    if key not in _measured:
        torch.manual_seed(0)
        holder = _OneBlock(config).to(device)
        apply_activation_checkpointing(holder, mode)
        run = _block_run(holder.layers[0], config, batch, seq_len, seq_len, precision, device)
        _measured[key] = _timed(run)
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

        _measured[key] = _timed(run)
    return _measured[key]


def rank_block_seconds(
    config: LlamaConfig, batch: int, seq_len: int, tp: int, sp: bool, mode: str, precision: str, ranks: int
) -> float:
    """Seconds of one block's forward + backward (recompute included; tp's shard and collectives
    when tp > 1) on `batch` sequences of `seq_len` tokens, timed in `ranks` forked processes (tp
    groups of `tp`) that compute at once."""
    key = ("ranks block", repr(config), batch, seq_len, tp, sp, mode, precision, ranks)
    if key not in _measured:
        pool = _pools.get((tp, ranks)) or _pools.setdefault((tp, ranks), _Ranks(tp, ranks))
        try:
            _measured[key] = pool.time((config, batch, seq_len, sp, mode, precision))
        except RuntimeError:
            del _pools[tp, ranks]  # closed: the next probe starts fresh ranks
            raise
    return _measured[key]


def _time_block(
    group: Any, config: LlamaConfig, batch: int, seq_len: int, sp: bool, mode: str, precision: str
) -> float:
    """In a probe rank: the block's time (the slowest rank's, agreed), tp-sharded when tp > 1."""
    torch.manual_seed(0)
    tp = dist.get_world_size(group)
    holder = _OneBlock(config)
    if tp > 1:
        apply_tensor_parallel(holder, BLOCK_TP_PLAN, group, sequence_parallel=sp)
    apply_activation_checkpointing(holder, mode)
    local = seq_len // tp if sp else seq_len
    run = _block_run(holder.layers[0], config, batch, seq_len, local, precision)

    def slowest(seconds: float) -> float:
        # every probe rank: the run's seconds, maxed -- the slowest rank's time counts, all ranks
        # see the same figures (so they stop after the same run), and they start the next together
        figure = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(figure, op=dist.ReduceOp.MAX)
        return float(figure)

    return _timed(run, slowest, RANK_PICK)


def join_local_gloo(rank: int, world: int, port: int) -> None:
    """In a forked measuring process: one thread, as a gloo test rank runs, and a gloo world of its
    own on this host (the calibration's pair, the probe ranks), not a run's."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=WAIT_S),
    )


def _rank_main(rank: int, world: int, tp: int, port: int, requests: Any, results: Any) -> None:
    """A probe rank: joins the group, then times each requested block until told to stop (None)."""
    join_local_gloo(rank, world, port)
    group = ParallelContext(tp=tp, timeout=timedelta(seconds=WAIT_S)).tp_group  # the rest of the world is dp
    try:
        while (request := requests.get()) is not None:
            try:
                seconds = _time_block(group, *request)
            except Exception as e:  # the parent raises it; the other ranks are stopped with the pool
                results.put(f"rank {rank}: {type(e).__name__}: {e}")
                return
            if rank == 0:
                results.put(seconds)
    finally:
        dist.destroy_process_group()


class _Ranks:
    """`world` forked gloo ranks in tp groups of `tp`, kept for the probes of a search."""

    def __init__(self, tp: int, world: int) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("fork")
        port = free_port()
        self.requests = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(
                target=_rank_main, args=(r, world, tp, port, self.requests[r], self.results), daemon=True
            )
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def time(self, request: tuple) -> float:
        for q in self.requests:
            q.put(request)
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            try:
                answer = self.results.get(timeout=1)
            except queue.Empty:
                if all(p.is_alive() for p in self.procs):
                    continue
                answer = "a probe rank exited"
            if isinstance(answer, float):
                return answer
            self.close()
            raise RuntimeError(f"the block probe in ranks failed: {answer}")
        self.close()
        raise RuntimeError(f"the block probe in ranks did not answer in {WAIT_S} s")

    def close(self) -> None:
        for q in self.requests:
            q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


_pools: dict[tuple[int, int], _Ranks] = {}


def stop_probe_ranks() -> None:
    """Stop the probe ranks (a search is over: they would hold memory through the run)."""
    while _pools:
        _pools.popitem()[1].close()


@atexit.register
def forget_probes() -> None:
    """Forget the kept probes and stop the probe ranks (a benchmark re-measures after
    re-calibrating; at exit, nothing is left running)."""
    _measured.clear()
    stop_probe_ranks()
