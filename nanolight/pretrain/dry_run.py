"""`+dry_run=true`: a layout's real program, one rank at a time, at the full world size, on this CPU.

Why: before a job of hundreds of GPUs is queued, the questions are whether it starts, fits and
what a step costs; the planner answers with formulas, and formulas drift from the code. Here the
code itself answers. One process plays one rank r of a world of N through torch's fake process
group (``torch.testing._internal.distributed.fake_pg``: every collective returns at once, with
nothing in it) and builds the recipe's module, `Parallel3DStrategy`, optimizer and schedule under
``FakeTensorMode`` (tensors with shapes and dtypes, no storage), then trains two optimizer steps
on a synthetic batch of the run's shape. Nothing is reimplemented: the strategy cuts, materialises,
initialises and wraps the model as in a run, and the trainer runs its steps.

Measured per role (ranks of one pipeline stage run the same program with other peers: tp, cp
and dp ranks hold shards of the same shapes, so one of them runs):
- memory: torch's ``MemTracker`` from the first step on, its parts labelled by what holds them
  (weights: the module's parameters; gradients: the reduction buckets and shards; optimizer
  state: the optimizer's state and ZeRO-1's fp32 masters; communication: buffers a collective or
  message writes into; activations and backward temporaries: the rest), at the peak;
- traffic: every collective and point-to-point message of each step, its group and bytes;
- host syncs: reads of a device value on the host (`.item()`, `bool()`, a data-dependent shape),
  where a GPU run waits; a fake tensor has no value, so the dry run stops there and names it;
- time: each operator's roofline on the named GPU (`pretrain/roofline.py`: its FLOPs -- torch's
  ``flop_registry``, the counts behind ``RuntimeEstimator`` -- at the table's peak, or the bytes a
  GPU run moves at the memory bandwidth, whichever is longer) and each collective by the
  planner's ring model (`planner/timing.py` `ring_seconds`).

What a fake tensor cannot do is left out: checkpoint saves, logging and the callbacks that read
values (a fake tensor has none). A pipeline stage learns its input's shape from a handshake that a
fake world never delivers; `boundary_shapes` answers in its place (`parallel/pipeline/stage.py`
`fake_world`: the handshake is still posted, and each shape a stage sends is checked against it).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)
from torch.distributed._tools.fake_collectives import CollectiveOp, collective_ops, sync_ops
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from nanolight.callbacks import Callback
from nanolight.errors import UsageError
from nanolight.parallel.config import ParallelConfig
from nanolight.parallel.launcher import join_fake_world
from nanolight.parallel.pipeline.p2p import Shape
from nanolight.parallel.zero import ZeroOptimizer
from nanolight.planner.hardware import Hardware, hardware
from nanolight.planner.timing import ring_seconds
from nanolight.pretrain.config import PretrainConfig
from nanolight.pretrain.module import CausalLMPretrain
from nanolight.pretrain.roofline import Roofline
from nanolight.pretrain.run import build_strategy, check_layout
from nanolight.trainer import NanoTrainer

GIB = 2**30
STEPS = 2
PARTS = ("weights", "gradients", "optimizer_state", "activations", "communication", "temporaries")
# MemTracker's reference types -> the report's parts ("Other": what the labels below say is traffic)
TRACKER_PARTS = {
    "Parameter": "weights",
    "Buffer": "weights",
    "Gradient": "gradients",
    "Optstate": "optimizer_state",
    "Activation": "activations",
    "Other": "communication",
    "Temp": "temporaries",
}
GROUP_NAMES = ("tp", "cp", "dp", "pp", "replica", "loss")
P2P_OPS = ("send", "recv_")  # the c10d operators of a point-to-point message


class StepsMemTracker(MemTracker):
    """``MemTracker`` over training steps. It refuses a root module's second call (one iteration
    per tracker) and a step calls the model once per micro-batch, so the root's module statistics
    restart there; the device totals and the peak, which the report reads, run on. `label` files a
    storage under a part (e.g. gradient buckets made before the tracker started)."""

    def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
        try:
            super()._pre_fw_hook(module, inputs)
        except NotImplementedError:  # the next micro-batch's call of the root module
            del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

    def _update_peak_stats(self, peak_state: Any) -> None:
        # the report reads the device peak only: the per-module peaks are not kept (their walk over
        # every tracked module at every operator was a third of smollm-1.7b's pipelined dry run)
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot["Total"]:
                self._peak_mem[device] = snapshot["Total"]
                self._peak_mem_snap[device] = dict(snapshot)

    def restart_peak(self) -> None:
        """Count the peak from now on. Setup draws each full, unsharded weight on the host to keep
        its slice (`parallel/shard.py`), on the CPU in a GPU run too: at llama3-8b, tp 8, the
        128,256 x 4,096 embedding (2.1 GB fp32) once outweighed the training step's device peak."""
        self._peak_mem = {device: snap["Total"] for device, snap in self._curr_mem_snap.items()}
        self._peak_mem_snap = {device: dict(snap) for device, snap in self._curr_mem_snap.items()}

    def _update_and_maybe_create_winfos(
        self, t: torch.Tensor | None, reftype: Any, update_existing: bool = False
    ) -> set[Any]:
        # the tracker's post-accumulate hook reads ``param.grad``; under main gradients (bf16-master)
        # the strategy's own hook, registered first, has already moved it into the fp32 bucket
        if t is None:
            return set()
        return super()._update_and_maybe_create_winfos(t, reftype, update_existing)

    def label(self, kind: str, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            self._update_and_maybe_create_winfos(t, _MemRefType(kind))

    def peak_parts(self) -> dict[str, int]:
        """The parts at the peak of the device the program runs on. A "meta" tensor holds no memory
        anywhere, yet the tracker files its nominal bytes under a device of its own: the model the
        strategy builds on meta before it materialises it (every weight in fp32, 6.75 GiB at
        smollm-1.7b) was once summed in as activations."""
        parts = dict.fromkeys(PARTS, 0)
        for device, device_snapshot in self.get_tracker_snapshot("peak").items():
            if device.type == "meta":
                continue
            for key, nbytes in device_snapshot.items():
                if key != "Total":
                    parts[TRACKER_PARTS[key.value]] += nbytes
        return parts


@dataclass
class Message:
    """One collective or point-to-point operation of a step, as this rank issued it."""

    step: int
    op: str  # the c10d operator: allreduce_, _allgather_base_, send, recv_, ...
    group: str  # "tp", "dp", "replica", ... or the ranks
    ranks: tuple[int, ...]
    nbytes: int
    peer: int | None = None  # point-to-point: the other end's global rank


class Traffic(TorchDispatchMode):
    """Records every c10d operation that passes the dispatcher (the fake process group's included)
    and files its receive and gather buffers under "communication" in the memory tracker."""

    def __init__(self, names: dict[tuple[int, ...], str], memory: StepsMemTracker, hw: Hardware) -> None:
        super().__init__()
        self.names, self.memory, self.hw = names, memory, hw
        self.step = 0
        self.messages: list[Message] = []
        self.pinned: set[int] = set()  # storages labelled weights / gradients / optimizer state

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in collective_ops and func not in sync_ops:
            group = CollectiveOp.get_process_group(func, args)
            ranks = tuple(dist.get_process_group_ranks(group))
            nbytes = CollectiveOp.get_comm_tensor_size(func, out, args, kwargs)
            op = func._overloadpacket.__name__
            peer = ranks[args[2]] if op in P2P_OPS else None
            name = self.names.get(ranks) or ("world" if len(ranks) == dist.get_world_size() else _span(ranks))
            self.messages.append(Message(self.step, op, name, ranks, nbytes, peer))
            written = args[0] if op in ("recv_", "allgather_", "_allgather_base_", "broadcast_") else []
            for t in tree_flatten(written)[0]:
                if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in self.pinned:
                    self.memory.label("Other", [t])
        return out

    def seconds(self, step: int) -> float:
        """The step's collectives and messages by the planner's ring model (one after another)."""
        total = 0.0
        for m in self.messages:
            if m.step != step:
                continue
            nodes = {r // self.hw.gpus_per_node for r in m.ranks}
            link = self.hw.intra_node_bandwidth if len(nodes) == 1 else self.hw.inter_node_bandwidth
            bandwidth = link * self.hw.link_efficiency
            if m.peer is not None:
                total += self.hw.latency + (m.nbytes / bandwidth if m.op == "send" else 0.0)
            elif m.op == "allreduce_":
                total += ring_seconds(len(m.ranks), m.nbytes, bandwidth, self.hw.latency)
            else:
                total += ring_seconds(len(m.ranks), m.nbytes, bandwidth, self.hw.latency, all_reduce=False)
        return total


class _Clock(Callback):
    """Starts the measurements once the strategy has set everything up (the memory tracker then
    labels what setup made) and tells each recorder which step an operation belongs to."""

    def __init__(self, memory: StepsMemTracker, traffic: Traffic, roofline: Roofline) -> None:
        self.memory, self.traffic, self.roofline = memory, traffic, roofline

    def on_train_start(self, trainer: NanoTrainer, pl_module: Any) -> None:
        strategy = trainer.strategy
        buffers = held_by_gradient_sync(getattr(strategy, "grads", None), trainer.optimizers)
        inner = [o for o in trainer.optimizers if isinstance(o, torch.optim.Optimizer)]
        inner += [o.inner for o in trainer.optimizers if isinstance(o, ZeroOptimizer)]
        stage = getattr(strategy, "stage", None)
        if stage is not None and dist.get_backend() == "fake":  # its handshakes deliver nothing
            stage.fake_world(boundary_shapes(strategy.config, pl_module))
        self.memory.track_external(pl_module, *inner)
        self.memory.label("Gradient", buffers[0])
        self.memory.label("Optstate", buffers[1])
        self.memory.restart_peak()
        params = [p for p in pl_module.parameters()]
        self.traffic.pinned = {id(t.untyped_storage()) for t in params + buffers[0] + buffers[1]}

    def on_train_batch_start(self, trainer: NanoTrainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.traffic.step = self.roofline.step = trainer.global_step


def boundary_shapes(parallel: ParallelConfig, module: torch.nn.Module) -> Callable[[Hashable], Shape]:
    """What crosses a pipeline boundary for a step's input (B, T) (the exchange's key: the input's
    shape, the boundary): the residual stream (B, T, hidden), its sequence split tp ways under
    sequence parallelism, in the weights' dtype (autocast's outputs join an fp32 residual)."""
    weight = next(p for p in module.parameters() if p.is_floating_point())
    hidden = module.model_config.hidden_size

    def shapes(key: Hashable) -> Shape:
        (batch, seq), _boundary = key
        seq //= parallel.tp if parallel.sequence_parallel else 1
        return torch.Size((batch, seq, hidden)), weight.dtype

    return shapes


def held_by_gradient_sync(grads: Any, optimizers: list[Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The gradient buffers (dp buckets, ZeRO-1's reduced shards) and the optimizer's own tensors
    (ZeRO-1's fp32 masters) that setup made: `GradientSync`'s (`grads`, None on one process) and
    each `ZeroOptimizer`'s among `optimizers`. One process under bf16-master steps a one-rank
    `ZeroOptimizer` without a `GradientSync`: its fp32 gradients and masters once read as
    activations (gradients 0)."""
    reducers = [grads.reducer] if getattr(grads, "reducer", None) is not None else []
    zeros = [o for o in optimizers if isinstance(o, ZeroOptimizer)]
    reducers += [z.reducer for z in zeros if all(z.reducer is not r for r in reducers)]
    gradients = [t for r in reducers for t in [b.buffer for b in r.buckets] + list(r.shard_grads)]
    return gradients, [m for z in zeros for m in z.master]


@dataclass
class RoleReport:
    """One rank's measurements; `like` counts the ranks that run the same program."""

    rank: int
    coords: dict[str, int]
    like: int
    parts: dict[str, int]
    messages: list[Message]
    compute_s: float  # the last step's roofline, matmuls at the GPU's peak (RuntimeEstimator's)
    table_compute_s: float  # the same, matmuls at the table's rate (`Roofline.table_seconds`)
    comm_s: float  # the last step's collectives, one after another
    flops: float
    host_syncs: int = 0  # the last step's reads of a device value on the host (`Roofline.host_syncs`)

    @property
    def peak(self) -> int:
        return sum(self.parts.values())

    def step_traffic(self, step: int) -> list[tuple[str, str, int, int]]:
        """(op, group, count, bytes) of one step, most bytes first."""
        counts: Counter = Counter()
        sizes: Counter = Counter()
        for m in self.messages:
            if m.step == step:
                counts[m.op, m.group] += 1
                sizes[m.op, m.group] += m.nbytes
        return sorted(((op, g, counts[op, g], sizes[op, g]) for op, g in counts), key=lambda r: -r[3])

    def step_p2p(self, step: int) -> list[tuple[str, str, int, int, int]]:
        """(op, group, peer, count, bytes) of one step's point-to-point messages, by peer."""
        counts: Counter = Counter()
        sizes: Counter = Counter()
        for m in self.messages:
            if m.step == step and m.peer is not None:
                counts[m.op, m.group, m.peer] += 1
                sizes[m.op, m.group, m.peer] += m.nbytes
        return [(*key, counts[key], sizes[key]) for key in sorted(counts, key=lambda k: (k[2], k[0]))]


@dataclass
class DryRunReport:
    world: int
    gpu: str
    memory_bytes: int
    roles: list[RoleReport] = field(default_factory=list)

    def misfits(self) -> list[str]:
        """One line per role whose peak is over the GPU's memory: which rank, which part, by how much."""
        lines = []
        for r in self.roles:
            over = r.peak - self.memory_bytes
            if over > 0:
                part = max(r.parts, key=r.parts.get)
                lines.append(
                    f"rank {r.rank} ({_where(r.coords)}) does not fit a {self.gpu}: it needs {r.peak / GIB:.2f} GiB "
                    f"of {self.memory_bytes / GIB:.2f} GiB, {over / GIB:.2f} GiB over; its largest part is "
                    f"{part} ({r.parts[part] / GIB:.2f} GiB)"
                )
        return lines

    def render(self) -> str:
        out = [
            f"dry run: {self.world} ranks of {self.gpu} ({self.memory_bytes / GIB:.1f} GiB each), {STEPS} steps"
        ]
        for r in self.roles:
            parts = ", ".join(f"{k} {v / GIB:.3f}" for k, v in r.parts.items())
            out.append(
                f"rank {r.rank} ({_where(r.coords)}; {r.like} ranks like it): peak {r.peak / GIB:.3f} GiB = {parts}"
            )
            for op, group, count, nbytes in r.step_traffic(STEPS - 1):
                if op not in P2P_OPS:
                    out.append(
                        f"  step {STEPS}: {count:4d} x {op:<16} on {group:<8} {nbytes / 2**20:12.2f} MiB"
                    )
            for op, group, peer, count, nbytes in r.step_p2p(STEPS - 1):
                way = f"{'to' if op == 'send' else 'from'} rank {peer}"
                out.append(
                    f"  step {STEPS}: {count:4d} x {op:<16} on {group:<8} {nbytes / 2**20:12.2f} MiB  {way}"
                )
            out.append(
                f"  step time: compute {r.compute_s * 1e3:.1f} ms (roofline, {r.flops / 1e12:.2f} TFLOP; "
                f"{r.table_compute_s * 1e3:.1f} ms with matmuls at the table's rate) + "
                f"communication {r.comm_s * 1e3:.1f} ms (ring model, not overlapped); {r.host_syncs} host syncs"
            )
        out += self.misfits()
        return "\n".join(out)


def _span(ranks: tuple[int, ...]) -> str:
    """A group without a name (e.g. the tied embedding's first and last stage): its ranks."""
    return ",".join(map(str, ranks)) if len(ranks) <= 4 else f"{ranks[0]},..,{ranks[-1]} ({len(ranks)})"


def _where(coords: dict[str, int]) -> str:
    return " ".join(f"{k}{v}" for k, v in coords.items())


def dry_run(config: PretrainConfig, stages: Iterable[int] | None = None) -> DryRunReport:
    """Every role of `config`'s layout on `+cluster.gpus` (default: tp*pp*cp*dp) GPUs of `+cluster.gpu`;
    `stages`: only these pipeline stages' roles (a full-size role takes minutes: a comparison with the
    planner runs the one at its peak)."""
    if config.cluster.gpus is not None and config.parallel.dp == 1:  # dp fills the named world
        config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, dp="auto"))
    p = config.parallel
    world = config.cluster.gpus or p.replica_ranks * (1 if p.dp == "auto" else p.dp)
    check_layout(dataclasses.replace(config, parallel=dataclasses.replace(p, dp=p.resolve_dp(world))))
    gpu = config.cluster.gpu or "h100-sxm"
    hw = hardware(gpu)
    report = DryRunReport(world, gpu, hw.memory_bytes)
    roles = range(p.pp) if stages is None else sorted(set(stages))
    if not set(roles) <= set(range(p.pp)):
        raise UsageError(f"stages {list(roles)} are not all pipeline stages of pp={p.pp} (0..{p.pp - 1})")
    for stage in roles:
        rank = stage * p.tp  # dp, cp and tp coordinate 0 of this stage
        report.roles.append(run_role(config, rank, world, hw))
        report.roles[-1].like = world // p.pp
    return report


def run_role(config: PretrainConfig, rank: int, world: int, hw: Hardware) -> RoleReport:
    """Rank `rank` of a fake world of `world`: the recipe's module and strategy, `STEPS` optimizer steps."""
    if dist.is_initialized():
        raise UsageError(
            "the dry run plays one rank of a fake world: call it where no process group is joined"
        )
    join_fake_world(rank, world)
    try:
        strategy = build_strategy(config)
        strategy.setup_environment()  # the groups: rank bookkeeping on the host, before fake tensors
        ctx = strategy.parallel.context
        names: dict[tuple[int, ...], str] = {}
        for name in reversed(GROUP_NAMES) if ctx is not None else ():  # earlier names win alike groups
            names[tuple(ctx.ranks(name))] = name
        with FakeTensorMode(allow_non_fake_inputs=True):
            memory, traffic, roofline = measured_fit(config, strategy, hw, names)
        last = STEPS - 1
        coords = {d: ctx.coords[d] if ctx is not None else 0 for d in ("pp", "tp", "cp", "dp")}
        return RoleReport(
            rank,
            coords,
            1,
            memory.peak_parts(),
            traffic.messages,
            roofline.seconds[last],
            roofline.table_seconds[last],
            traffic.seconds(last),
            roofline.flops[last],
            roofline.host_syncs[last],
        )
    except (DataDependentOutputException, DynamicOutputShapeException) as exc:
        # a fake tensor has no value to give: the program read one on the host, where a GPU run waits
        raise UsageError(
            f"the dry run stopped on rank {rank}: the training step reads a tensor's value on the host "
            f"({exc.func}: `.item()`, `bool()`, `.tolist()` or a data-dependent shape), which a GPU run "
            "waits for the device to reach and a fake tensor does not have; read values only on logging "
            "steps (every `trainer.log_every_n_steps`)"
        ) from exc
    finally:
        dist.destroy_process_group()


def measured_fit(
    config: PretrainConfig, strategy: Any, hw: Hardware, names: dict[tuple[int, ...], str]
) -> tuple[StepsMemTracker, Traffic, Roofline]:
    """The recipe's module trained `STEPS` steps through `strategy` on a batch of the run's shape,
    measured; fake tensors if called under ``FakeTensorMode``, real ones otherwise (tests compare)."""
    t = config.trainer
    memory = StepsMemTracker()
    traffic, roofline = Traffic(names, memory, hw), Roofline(hw)
    shape = (t.micro_batch_size, t.seq_len)
    ids = torch.zeros(shape, dtype=torch.long)  # token 0 everywhere: the same work as any tokens
    batches = [{"input_ids": ids, "target_ids": ids} for _ in range(STEPS * t.accumulate_grad_batches)]
    # the GPU's optimizer kernel (fused AdamW on CUDA), not the CPU's foreach one (3x its bytes)
    module = CausalLMPretrain(config.model, config.optim, t.seq_len, STEPS, kernels=hw.device)
    trainer = NanoTrainer(
        max_steps=STEPS,
        accumulate_grad_batches=t.accumulate_grad_batches,
        gradient_clip_val=t.gradient_clip_val,
        precision=t.run_precision,
        log_every_n_steps=STEPS + 1,  # no logging step: a fake value cannot be read
        val_check_interval=None,
        callbacks=[_Clock(memory, traffic, roofline)],
        logger=False,
        strategy=strategy,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        seed=config.seed,
    )
    trainer.preemption.save_on_signal = False  # SIGTERM ends a dry run: no fake checkpoint to save
    with memory, traffic, roofline:
        trainer.fit(module, batches)
    return memory, traffic, roofline
