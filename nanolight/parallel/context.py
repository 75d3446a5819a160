"""`ParallelContext`: the world split into named parallel dimensions and their process groups.

This is the only object in nanolight that knows ranks and process groups; everything else is
handed the group it needs. The ranks form an N-D array, `mesh`, with one named dimension per
kind of parallelism, outermost first (torchtitan's `parallel_dims.py` order):

    MESH_DIMS = ("dp", "cp", "pp", "tp")
    global_rank = ((dp_rank * cp + cp_rank) * pp + pp_rank) * tp + tp_rank

tp is innermost (its collectives run every layer, so its ranks should share a node and its
NVLink), then pp, then cp (context parallelism: a ring of ranks holding other tokens of the same
sequences, `ring_attention.py`), then dp (the least frequent traffic). A group along one dimension is the ranks that differ only in that coordinate.

Some concerns span several dimensions; they get named flattened groups (`FLATTENED`): "batch" the
ranks reading different samples (dp), "loss" the ranks holding different tokens of the global
batch, over which the step's valid targets are counted (dp x cp), "replica" the ranks holding the
same weights, over which gradients reduce (dp x cp). At cp = 1 "loss" and "replica" are the dp
groups themselves (the same process group, not a copy).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from nanolight.parallel.config import ParallelConfig

MESH_DIMS = ("dp", "cp", "pp", "tp")  # outermost first: tp's ranks are adjacent global ranks
FLATTENED: dict[str, tuple[str, ...]] = {
    "batch": ("dp",),  # different samples: the sampler's replicas
    "loss": ("dp", "cp"),  # different tokens of the global batch: the valid-target count sums here
    "replica": ("dp", "cp"),  # the same weights: gradients reduce (and ZeRO-1 shards) here
}


def rank_mesh(tp: int, pp: int, dp: int, cp: int = 1) -> torch.Tensor:
    """Global ranks laid out as a (dp, cp, pp, tp) integer tensor (tp varies fastest)."""
    sizes = {"dp": dp, "cp": cp, "pp": pp, "tp": tp}
    return torch.arange(dp * cp * pp * tp).view(*(sizes[d] for d in MESH_DIMS))


def group_ranks(mesh: torch.Tensor, dims: str | Sequence[str]) -> list[list[int]]:
    """Every process group along mesh dimension(s) `dims` (e.g. "tp", or ("dp", "cp") flattened,
    the first named outermost), as lists of ranks.

    Moving `dims` last (in their order) and flattening the rest gives one row per group; pure
    arithmetic, so the layout is unit-testable without spawning processes.
    """
    dims = (dims,) if isinstance(dims, str) else tuple(dims)
    axes = [MESH_DIMS.index(d) for d in dims]
    size = 1
    for axis in axes:
        size *= mesh.shape[axis]
    return mesh.movedim(axes, list(range(-len(axes), 0))).reshape(-1, size).tolist()


def coordinates(mesh: torch.Tensor, rank: int) -> dict[str, int]:
    """The coordinate of a global rank along each mesh dimension, keyed by dimension name."""
    position = (mesh == rank).nonzero()
    if position.numel() == 0:
        raise ValueError(f"rank {rank} is not in a mesh of {mesh.numel()} ranks")
    return dict(zip(MESH_DIMS, position[0].tolist(), strict=True))


class ParallelContext:
    """Process groups for one (dp, cp, pp, tp) layout of an initialised `torch.distributed` world.

    Construct it on every rank, in the same order (group creation is collective). The default
    process group must already exist: `nanolight.parallel.launcher.init_distributed` makes it
    from torchrun/SLURM/subprocess environments (NCCL on GPU, gloo on CPU).

    Each dimension's group, rank, size and member list are attributes (`tp_group`, `cp_rank`,
    `dp_size`, `pp_ranks`, ...); every group, a dimension's or a flattened one's, is also asked
    for by name: `group("loss")`, `rank_in("loss")`, `size("loss")`, `ranks("loss")`.
    """

    def __init__(
        self,
        tp: int = 1,
        pp: int = 1,
        dp: int | str = "auto",
        timeout: timedelta = timedelta(minutes=10),
        cp: int = 1,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ParallelContext needs an initialised torch.distributed world; call "
                "nanolight.parallel.launcher.init_distributed() (or dist.init_process_group) first"
            )
        self.world_size = dist.get_world_size()
        self.global_rank = dist.get_rank()
        self.timeout = timeout  # every group's: a stopped peer ends a collective within it
        config = ParallelConfig(tp=tp, pp=pp, dp=dp, cp=cp)
        self.sizes = {"dp": config.resolve_dp(self.world_size), "cp": cp, "pp": pp, "tp": tp}
        self.backend = str(dist.get_backend())
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if self.backend == "nccl"
            else torch.device("cpu")
        )
        self.mesh = rank_mesh(tp, pp, self.sizes["dp"], cp)
        self.coords = coordinates(self.mesh, self.global_rank)

        # Every rank must call new_group for every group, in the same order, even for groups it
        # is not a member of; it keeps the handle of the one it belongs to. A name whose groups
        # hold the same ranks as an earlier name's shares its process group (at cp = 1 "loss" is dp).
        self._groups: dict[str, Any] = {}
        self._ranks: dict[str, list[int]] = {}
        made: dict[tuple[tuple[int, ...], ...], Any] = {}  # partition of the world -> my group in it
        for name, dims in [*((d, (d,)) for d in ("tp", "pp", "dp", "cp")), *FLATTENED.items()]:
            partition = group_ranks(self.mesh, dims)
            key = tuple(map(tuple, partition))
            if key not in made:
                made[key] = self._new_groups(partition)
            self._groups[name] = made[key]
            self._ranks[name] = next(ranks for ranks in partition if self.global_rank in ranks)
        # The pipeline's point-to-point traffic, both directions, on one group of its own (one NCCL
        # communicator: `pipeline/p2p.py`); none without pp.
        self.pp_p2p_group = self._new_groups(group_ranks(self.mesh, "pp")) if pp > 1 else None
        if self.pp_p2p_group is not None:
            # every stage of this pipeline joins one all-reduce of a zero on the group, so that the
            # group's first operation has all its ranks (torch's rule for a first
            # batch_isend_irecv; under NCCL it creates the group's communicator with all of them)
            dist.all_reduce(torch.zeros(1, device=self.device), group=self.pp_p2p_group)
        # Host-side agreements (pre-emption flags, picklable objects) travel on the CPU: a gloo
        # group over the whole world, also when the world itself is gloo, so that the device
        # groups carry the same operations on CPU as on GPUs. Not the rendezvous store: under
        # torchrun the agent hosts it, and workers whose agent was killed must still agree to save
        # (tests/test_faults_distributed.py).
        # A fake world (the dry run: one process playing one rank of many) has no peers to meet on gloo.
        host = "fake" if self.backend == "fake" else "gloo"
        self.host_group = dist.new_group(backend=host, timeout=timeout)

    @classmethod
    def from_config(
        cls, config: ParallelConfig, timeout: timedelta = timedelta(minutes=10)
    ) -> ParallelContext:
        return cls(tp=config.tp, pp=config.pp, dp=config.dp, timeout=timeout, cp=config.cp)

    def _new_groups(self, partition: list[list[int]]) -> Any:
        mine = None
        for ranks in partition:
            group = dist.new_group(ranks=ranks, timeout=self.timeout)
            if self.global_rank in ranks:
                mine = group
        return mine

    # ---- groups by name: a mesh dimension ("dp", "cp", "pp", "tp") or a flattened one (`FLATTENED`)
    def group(self, name: str) -> Any:
        """This rank's process group of `name`."""
        return self._groups[self._known(name)]

    def ranks(self, name: str) -> list[int]:
        """The global ranks of this rank's group of `name`, in group-rank order."""
        return list(self._ranks[self._known(name)])

    def size(self, name: str) -> int:
        return len(self._ranks[self._known(name)])

    def rank_in(self, name: str) -> int:
        """This rank's rank within its group of `name`."""
        return self._ranks[self._known(name)].index(self.global_rank)

    def _known(self, name: str) -> str:
        if name not in self._groups:
            raise KeyError(f"no parallel group named {name!r}; known: {sorted(self._groups)}")
        return name

    # The per-dimension names the rest of nanolight reads (`ctx.tp_group`, `ctx.dp_rank`, ...).
    tp_size = property(lambda self: self.sizes["tp"])
    pp_size = property(lambda self: self.sizes["pp"])
    cp_size = property(lambda self: self.sizes["cp"])
    dp_size = property(lambda self: self.sizes["dp"])
    tp_rank = property(lambda self: self.coords["tp"])
    pp_rank = property(lambda self: self.coords["pp"])
    cp_rank = property(lambda self: self.coords["cp"])
    dp_rank = property(lambda self: self.coords["dp"])
    tp_group = property(lambda self: self._groups["tp"])
    pp_group = property(lambda self: self._groups["pp"])
    cp_group = property(lambda self: self._groups["cp"])
    dp_group = property(lambda self: self._groups["dp"])
    tp_ranks = property(lambda self: self.ranks("tp"))
    pp_ranks = property(lambda self: self.ranks("pp"))
    cp_ranks = property(lambda self: self.ranks("cp"))
    dp_ranks = property(lambda self: self.ranks("dp"))

    def stage_pair_group(self, first: int, last: int) -> Any:
        """The group of this rank's (dp, cp, tp) coordinate at pipeline stages `first` and `last`
        (the tied embedding's two copies). Collective: every rank creates every pair's group, in order."""
        tp, pp = self.tp_size, self.pp_size  # a rank's stage is (rank // tp) % pp: tp fastest, then pp
        # plain integers, no tensor op: under the dry run's fake tensors a mesh op has no values
        at_first, at_last = (
            [r for r in range(self.world_size) if (r // tp) % pp == s] for s in (first, last)
        )
        return self._new_groups([[a, b] for a, b in zip(at_first, at_last, strict=True)])

    @property
    def pp_ring(self) -> tuple[int, int]:
        """Global ranks of the stages before/after this one round the ring of stages (rank 0's
        previous is the last stage): with virtual stages the last rank feeds rank 0's next chunk."""
        p, r = self.pp_size, self.pp_rank
        return self.pp_ranks[(r - 1) % p], self.pp_ranks[(r + 1) % p]

    # Pipeline neighbours: global ranks of the stages before/after this one (same dp, tp rank).
    @property
    def prev_pp_rank(self) -> int | None:
        return self.pp_ranks[self.pp_rank - 1] if self.pp_rank > 0 else None

    @property
    def next_pp_rank(self) -> int | None:
        return self.pp_ranks[self.pp_rank + 1] if self.pp_rank < self.pp_size - 1 else None

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    def device_mesh(self) -> Any:
        """The same layout as a torch `DeviceMesh`, its dimensions named, for torch-native features
        (DTensor, distributed checkpoint); cp is left out while it is 1, so they see (dp, pp, tp).
        Collective: every rank must call it, in the same order."""
        from torch.distributed.device_mesh import DeviceMesh

        dims = tuple(d for d in MESH_DIMS if d != "cp" or self.cp_size > 1)
        mesh = self.mesh.reshape([self.sizes[d] for d in dims])  # dropping a size-1 axis keeps the order
        return DeviceMesh(self.device.type, mesh, mesh_dim_names=dims)

    # ---- the collectives a strategy asks for by name ---------------------------------------
    def reduce_metric(
        self, tensor: torch.Tensor, op: str = "mean", from_last_stage: bool = False
    ) -> torch.Tensor:
        """One metric, the same on every rank: the last pipeline stage's value (`from_last_stage`:
        only it computed the loss), combined over the "loss" group -- dp replicas and cp ranks, each
        holding its own tokens of the global batch ("mean" | "sum" | "max" | "min")."""
        out = tensor.detach().float().clone().to(self.device)
        if from_last_stage and self.pp_size > 1:
            # the last stage sends its value to every stage of its pipeline
            dist.broadcast(out, src=self.pp_ranks[-1], group=self.pp_group)
        size = self.size("loss")
        if size > 1:  # tp ranks already hold identical metrics
            # dp x cp ranks combine their metric: summed (a mean divides after), or max / min
            reduce_op = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}.get(op, dist.ReduceOp.SUM)
            dist.all_reduce(out, op=reduce_op, group=self.group("loss"))
            out = out / size if op == "mean" else out
        return out

    def start_max(
        self, value: int, guard: Callable[[], AbstractContextManager] = nullcontext
    ) -> Agreed | PendingMax:
        """Start agreeing on the maximum of `value` over every rank, on the host (no device
        sync); ``.wait()`` gives it. One process, or a fake world (the dry run's: no peer holds a
        value): already agreed, no collective."""
        if self.world_size == 1 or self.backend == "fake":
            return Agreed(value)
        return PendingMax(value, self.host_group, guard)  # all ranks send an int, get the max

    def broadcast_object(
        self, obj: Any, src: int = 0, guard: Callable[[], AbstractContextManager] = nullcontext
    ) -> Any:
        """`obj` as global rank `src` holds it, on every rank, on the host (pickled; no device sync).
        A fake world's ranks (the dry run's) keep their own: no peer holds one to send."""
        if self.world_size == 1 or self.backend == "fake":
            return obj
        box = [obj]
        with guard():
            # rank `src` sends obj to every rank, pickled over the host group (gloo: no device sync)
            dist.broadcast_object_list(box, src=src, group=self.host_group)
        return box[0]

    def any_rank(self, flag: bool) -> bool:
        """True on every rank if `flag` is True on any rank (blocking, on the host)."""
        return bool(self.start_max(int(flag)).wait())

    def __repr__(self) -> str:
        return (
            f"ParallelContext(rank={self.global_rank}/{self.world_size}, tp={self.tp_rank}/{self.tp_size}, "
            f"pp={self.pp_rank}/{self.pp_size}, cp={self.cp_rank}/{self.cp_size}, dp={self.dp_rank}/{self.dp_size}, "
            f"backend={self.backend})"
        )

    def destroy(self) -> None:
        """Tear down every group (and the world); call once at the end of the process."""
        if dist.is_initialized():
            dist.destroy_process_group()


# Agreeing on a small integer over every rank without stalling the device or the step.
#
# Why: a question every rank must answer alike every step (pre-emption: "did a signal reach any
# rank, and which?") is an all-reduce of one integer. Done on the device under NCCL, reading the
# answer (``.item()``) makes the host wait for every kernel queued before it, once per step. So
# the answer travels on the host: an all-reduce of a CPU tensor over a gloo group
# (`ParallelContext.host_group`), started without waiting (``async_op=True``) and waited for later,
# typically at the next step, by when it has long arrived. Reading a CPU tensor is no device sync;
# it is read with ``.numpy()``, which a device tensor refuses, so the box cannot silently move to
# the GPU and bring the sync back.


class Agreed:
    """An agreement already complete (one process: nothing to exchange)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def wait(self) -> int:
        return self.value


class PendingMax:
    """The maximum of each rank's `value`, all-reduced over `group` (a gloo group), in flight
    until `wait`. `guard` wraps the start and the wait (e.g. a
    heartbeat watch that names a silent peer)."""

    def __init__(
        self, value: int, group: Any = None, guard: Callable[[], AbstractContextManager] = nullcontext
    ) -> None:
        self.guard = guard
        self.box = torch.tensor([value], dtype=torch.int64)  # on the host, always
        with guard():
            # every rank of `group` (the whole world) sends its integer; all receive the maximum
            self.work: Any = dist.all_reduce(self.box, op=dist.ReduceOp.MAX, group=group, async_op=True)
        self.value: int | None = None

    def wait(self) -> int:
        """The agreed value (the same on every rank); waits only if it has not arrived yet."""
        if self.value is None:
            with self.guard():
                self.work.wait()
            self.work = None  # let go of gloo's work object (and its hold on the box) at once
            self.value = int(self.box.numpy()[0])  # a host tensor: no device sync
        return self.value
