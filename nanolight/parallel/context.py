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
same weights, over which gradients reduce (dp x cp). At cp = 1 "batch" and "loss" are the dp
groups themselves (the same process group, not a copy); "replica" always has a communicator of its
own (`OWN_COMMUNICATOR`).

Set-up cost. Under NCCL with a bound device (`launcher.py`) every `new_group` call is an
``ncclCommSplit`` over the whole world, ranks outside the new group included: one call per group
of every partition would be ~2,200 world-wide operations at 1,024 ranks, 1,024 of them for cp's
one-rank groups. So each partition of the world is made with one call: `dist.split_group` (one
split, every group a colour) where the world can split, else `new_group` of this rank's own group
with ``use_local_synchronization`` (only its members meet: nothing world-wide). Either way the
world-wide work at start-up is O(number of partitions), not O(world) (`scripts/bench_counts.py`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from nanolight.parallel.agreement import PendingStoreMax, StoreAgreements, agreed
from nanolight.parallel.config import ParallelConfig

MESH_DIMS = ("dp", "cp", "pp", "tp")  # outermost first: tp's ranks are adjacent global ranks
FLATTENED: dict[str, tuple[str, ...]] = {
    "batch": ("dp",),  # different samples: the sampler's replicas
    "loss": ("dp", "cp"),  # different tokens of the global batch: the valid-target count sums here
    "replica": ("dp", "cp"),  # the same weights: gradients reduce (and ZeRO-1 shards) here
}
# Names whose traffic must not queue behind, or ahead of, another name's on one NCCL communicator
# (its ops run in issue order): "replica" carries the overlapped bulk traffic (each bucket's
# reduce-scatter, ZeRO-1's post-step all-gathers, waited for layer by layer in the next forward);
# the step's first blocking collective (the valid-target count, on "batch") and the metrics (on
# "loss") would otherwise wait behind every bucket's gather before the first layer runs.
OWN_COMMUNICATOR = ("replica",)


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

        # Every partition of the world is made once, by every rank, in the same order (`_partition`);
        # a name whose groups hold the same ranks as an earlier name's shares its process group (at
        # cp = 1 "loss" is dp) unless it asks for its own communicator.
        self._groups: dict[str, Any] = {}
        self._ranks: dict[str, list[int]] = {}
        self._splits = getattr(dist.group.WORLD, "bound_device_id", None) is not None
        made: dict[tuple, Any] = {}  # (partition of the world, own communicator) -> my group in it
        for name, dims in [*((d, (d,)) for d in ("tp", "pp", "dp", "cp")), *FLATTENED.items()]:
            partition = group_ranks(self.mesh, dims)
            key = (tuple(map(tuple, partition)), name if name in OWN_COMMUNICATOR else "")
            if key not in made:
                made[key] = self._partition(partition, name)
            self._groups[name] = made[key]
            self._ranks[name] = next(ranks for ranks in partition if self.global_rank in ranks)
        # The pipeline's point-to-point traffic, both directions, on one group of its own (one NCCL
        # communicator: `pipeline/p2p.py`); none without pp.
        self.pp_p2p_group = self._partition(group_ranks(self.mesh, "pp"), "pp_p2p") if pp > 1 else None
        if self.pp_p2p_group is not None:
            # every stage of this pipeline joins one all-reduce of a zero on the group, so that the
            # group's first operation has all its ranks (torch's rule for a first
            # batch_isend_irecv; under NCCL it creates the group's communicator with all of them)
            dist.all_reduce(torch.zeros(1, device=self.device), group=self.pp_p2p_group)
        # Host-side exchanges (picklable objects) travel on the CPU: a gloo group over the whole
        # world, also when the world itself is gloo, so that the device groups carry the same
        # operations on CPU as on GPUs. Not the rendezvous store: under torchrun the agent hosts
        # it, and workers whose agent was killed must still agree to save
        # (tests/test_faults_distributed.py). The per-step agreements use a store rank 0 hosts
        # (`agreement.py`), made at the first `agree_max`.
        # A fake world (the dry run, or counting set-up: one process playing one rank of many) has
        # no peers to meet on gloo: its host group is fake too.
        host = "fake" if self.backend == "fake" else "gloo"
        self.host_group = dist.new_group(backend=host, timeout=timeout)
        self._agreements: StoreAgreements | None = None

    @classmethod
    def from_config(
        cls, config: ParallelConfig, timeout: timedelta = timedelta(minutes=10)
    ) -> ParallelContext:
        return cls(tp=config.tp, pp=config.pp, dp=config.dp, timeout=timeout, cp=config.cp)

    def _partition(self, partition: list[list[int]], desc: str) -> Any:
        """This rank's group of `partition` (every global rank in exactly one of its lists, each
        list ascending), made with one call whatever the world's size (see the module docstring)."""
        if self._splits:
            # every rank of the world joins one ncclCommSplit; each list of the partition a colour
            return dist.split_group(split_ranks=partition, timeout=self.timeout, group_desc=desc)
        mine = next(ranks for ranks in partition if self.global_rank in ranks)
        # only `mine`'s members take part (a rendezvous in the store under the group's own prefix)
        return dist.new_group(mine, timeout=self.timeout, use_local_synchronization=True, group_desc=desc)

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
        (the tied embedding's two copies); None on the stages between. Collective: every rank calls it,
        in the same order (one partition: the pairs, and every other rank on its own)."""
        tp, pp = self.tp_size, self.pp_size  # a rank's stage is (rank // tp) % pp: tp fastest, then pp
        # plain integers, no tensor op: under the dry run's fake tensors a mesh op has no values
        at_first, at_last = (
            [r for r in range(self.world_size) if (r // tp) % pp == s] for s in (first, last)
        )
        pairs = [[a, b] for a, b in zip(at_first, at_last, strict=True)]
        ends = set(at_first) | set(at_last)
        others = [[r] for r in range(self.world_size) if r not in ends]
        group = self._partition(pairs + others, f"stages_{first}_{last}")  # the others: groups of one
        return group if self.global_rank in ends else None

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

    def agree_max(
        self, value: int, guard: Callable[[], AbstractContextManager] = nullcontext
    ) -> torch.futures.Future | PendingStoreMax:
        """Start agreeing on the maximum of `value` (>= 0) over every rank, on the host (no device
        sync, O(1) requests per rank: `agreement.py`); ``.wait()`` gives it. One process, or a fake
        world (the dry run's: no peer holds a value): already agreed. The first call on each rank is
        collective: it hands rank 0's store address round."""
        if self.world_size == 1 or self.backend == "fake":
            return agreed(value)
        if self._agreements is None:
            share = functools.partial(self.broadcast_object, src=0, guard=guard)
            self._agreements = StoreAgreements.hosted(self.global_rank, self.world_size, share, self.timeout)
        return self._agreements.start(value, guard)  # one add (and a rare compare-and-set) per rank

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
