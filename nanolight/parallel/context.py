"""`ParallelContext`: the world split into tensor-, pipeline- and data-parallel process groups.

This is the only object in nanolight that knows ranks and process groups; everything else is
handed the group it needs. The layout puts tp innermost (its collectives run every layer, so
its ranks should share a node and its NVLink), then pp, then dp (the least frequent traffic):

    global_rank = dp_rank * (pp * tp) + pp_rank * tp + tp_rank

i.e. the ranks form a (dp, pp, tp) array, `mesh`, and a tp group is a row of it, a pp group a
column across pipeline stages, and a dp group the ranks holding the same model shard.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from nanolight.parallel.agreement import Agreed, PendingMax, StoreAgreements
from nanolight.parallel.config import ParallelConfig

MESH_DIMS = ("dp", "pp", "tp")


def rank_mesh(tp: int, pp: int, dp: int) -> torch.Tensor:
    """Global ranks laid out as a (dp, pp, tp) integer tensor (tp varies fastest)."""
    return torch.arange(dp * pp * tp).view(dp, pp, tp)


def group_ranks(mesh: torch.Tensor, dim: str) -> list[list[int]]:
    """Every process group along mesh dimension `dim` ("dp", "pp" or "tp"), as lists of ranks.

    Moving `dim` last and flattening the rest gives one row per group; pure arithmetic, so the
    layout is unit-testable without spawning processes.
    """
    axis = MESH_DIMS.index(dim)
    return mesh.movedim(axis, -1).reshape(-1, mesh.shape[axis]).tolist()


def coordinates(mesh: torch.Tensor, rank: int) -> dict[str, int]:
    """(dp_rank, pp_rank, tp_rank) of a global rank, as a dict keyed by mesh dimension."""
    position = (mesh == rank).nonzero()
    if position.numel() == 0:
        raise ValueError(f"rank {rank} is not in a mesh of {mesh.numel()} ranks")
    return dict(zip(MESH_DIMS, position[0].tolist(), strict=True))


class ParallelContext:
    """Process groups for one (tp, pp, dp) layout of an initialised `torch.distributed` world.

    Construct it on every rank, in the same order (group creation is collective). The default
    process group must already exist: `nanolight.parallel.launcher.init_distributed` makes it
    from torchrun/SLURM/subprocess environments (NCCL on GPU, gloo on CPU).
    """

    def __init__(
        self, tp: int = 1, pp: int = 1, dp: int | str = "auto", timeout: timedelta = timedelta(minutes=10)
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ParallelContext needs an initialised torch.distributed world; call "
                "nanolight.parallel.launcher.init_distributed() (or dist.init_process_group) first"
            )
        self.world_size = dist.get_world_size()
        self.global_rank = dist.get_rank()
        self.timeout = timeout  # every group's: a stopped peer ends a collective within it
        config = ParallelConfig(tp=tp, pp=pp, dp=dp)
        self.tp_size, self.pp_size = tp, pp
        self.dp_size = config.resolve_dp(self.world_size)
        self.backend = str(dist.get_backend())
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if self.backend == "nccl"
            else torch.device("cpu")
        )
        self.mesh = rank_mesh(self.tp_size, self.pp_size, self.dp_size)
        coords = coordinates(self.mesh, self.global_rank)
        self.dp_rank, self.pp_rank, self.tp_rank = coords["dp"], coords["pp"], coords["tp"]

        # Every rank must call new_group for every group, in the same order, even for groups it
        # is not a member of; it keeps the handle of the one it belongs to.
        self.tp_group = self._new_groups("tp", timeout)
        self.pp_group = self._new_groups("pp", timeout)
        self.dp_group = self._new_groups("dp", timeout)
        # The pipeline's two point-to-point streams (activations forward, gradients backward), one
        # group each so that each is one FIFO per direction (`pipeline/p2p.py`); none without pp.
        self.pp_p2p_groups = (
            (self._new_groups("pp", timeout), self._new_groups("pp", timeout)) if pp > 1 else (None, None)
        )
        for group in self.pp_p2p_groups:
            if group is not None:
                # every stage of this pipeline joins one all-reduce of a zero on each stream's group,
                # so that the group's first operation has all its ranks (torch's rule for a first
                # batch_isend_irecv; under NCCL it creates the group's communicator with all of them)
                dist.all_reduce(torch.zeros(1, device=self.device), group=group)
        # Host-side agreements (pre-emption flags, picklable objects) go through the rendezvous
        # store every rank already holds a connection to: no world-wide group (`agreement.py`).
        store = dist.distributed_c10d._get_default_store()
        self.agreements = StoreAgreements(store, self.global_rank, self.world_size, timeout)
        self.tp_ranks = self.mesh[self.dp_rank, self.pp_rank, :].tolist()
        self.pp_ranks = self.mesh[self.dp_rank, :, self.tp_rank].tolist()
        self.dp_ranks = self.mesh[:, self.pp_rank, self.tp_rank].tolist()

    @classmethod
    def from_config(
        cls, config: ParallelConfig, timeout: timedelta = timedelta(minutes=10)
    ) -> ParallelContext:
        return cls(tp=config.tp, pp=config.pp, dp=config.dp, timeout=timeout)

    def _new_groups(self, dim: str, timeout: timedelta) -> Any:
        mine = None
        for ranks in group_ranks(self.mesh, dim):
            group = dist.new_group(ranks=ranks, timeout=timeout)
            if self.global_rank in ranks:
                mine = group
        return mine

    def stage_pair_group(self, first: int, last: int) -> Any:
        """The group of this rank's (dp, tp) coordinate at pipeline stages `first` and `last` (the
        tied embedding's two copies). Collective: every rank creates every pair's group, in order."""
        mine = None
        for d in range(self.dp_size):
            for t in range(self.tp_size):
                ranks = [int(self.mesh[d, first, t]), int(self.mesh[d, last, t])]
                group = dist.new_group(ranks=ranks, timeout=self.timeout)
                if self.global_rank in ranks:
                    mine = group
        return mine

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
        """The same layout as a torch `DeviceMesh` ("dp", "pp", "tp"), for torch-native features
        (DTensor, distributed checkpoint). Collective: every rank must call it, in the same order."""
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh(self.device.type, self.mesh, mesh_dim_names=MESH_DIMS)

    # ---- the collectives a strategy asks for by name ---------------------------------------
    def reduce_metric(
        self, tensor: torch.Tensor, op: str = "mean", from_last_stage: bool = False
    ) -> torch.Tensor:
        """One metric, the same on every rank: the last pipeline stage's value (`from_last_stage`:
        only it computed the loss), combined over dp ("mean" | "sum" | "max" | "min")."""
        out = tensor.detach().float().clone().to(self.device)
        if from_last_stage and self.pp_size > 1:
            # the last stage sends its value to every stage of its pipeline
            dist.broadcast(out, src=self.pp_ranks[-1], group=self.pp_group)
        if self.dp_size > 1:  # tp ranks already hold identical metrics
            # dp replicas combine their metric: summed (a mean divides after), or max / min
            reduce_op = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}.get(op, dist.ReduceOp.SUM)
            dist.all_reduce(out, op=reduce_op, group=self.dp_group)
            out = out / self.dp_size if op == "mean" else out
        return out

    def start_max(
        self, value: int, guard: Callable[[], AbstractContextManager] = nullcontext
    ) -> Agreed | PendingMax:
        """Start agreeing on the maximum of `value` over every rank, on the host (no device
        sync); ``.wait()`` gives it. One process: already agreed, no collective."""
        if self.world_size == 1:
            return Agreed(value)
        return self.agreements.start_max(value, guard)  # every rank posts an int, reads the max

    def broadcast_object(
        self, obj: Any, src: int = 0, guard: Callable[[], AbstractContextManager] = nullcontext
    ) -> Any:
        """`obj` as global rank `src` holds it, on every rank, on the host (pickled; no device sync)."""
        if self.world_size == 1:
            return obj
        return self.agreements.broadcast(obj, src, guard)  # rank `src` posts it, the others fetch it

    def any_rank(self, flag: bool) -> bool:
        """True on every rank if `flag` is True on any rank (blocking, on the host)."""
        return bool(self.start_max(int(flag)).wait())

    def __repr__(self) -> str:
        return (
            f"ParallelContext(rank={self.global_rank}/{self.world_size}, tp={self.tp_rank}/{self.tp_size}, "
            f"pp={self.pp_rank}/{self.pp_size}, dp={self.dp_rank}/{self.dp_size}, backend={self.backend})"
        )

    def destroy(self) -> None:
        """Tear down every group (and the world); call once at the end of the process."""
        if dist.is_initialized():
            dist.destroy_process_group()
