"""Records every point-to-point operation a rank issues, and checks the recordings by NCCL's rules.

The tests run on gloo, which forgives what NCCL does not: NCCL runs a batched op
(``batch_isend_irecv``) on the group's communicator and a plain ``send``/``recv`` on a separate
two-rank one (``ProcessGroupNCCL``, ``isP2POp(opType, batchP2P)``), so a batched send never meets
a plain receive; it moves bytes without checking shapes or dtypes; and torch's note on
``batch_isend_irecv`` requires every rank of a group to join the group's first batched call when
it is the group's first operation. gloo matches all of these anyway, so the tests emulate NCCL
by recording and checking:

- `install()` (in each rank's process) wraps ``torch.distributed``'s send / recv / isend / irecv /
  batch_isend_irecv (``P2POp`` keeps working: its check of the op sees the wrapped isend/irecv) and
  the collectives, and appends one `Op` per tensor sent or received, or per collective, in the
  order issued. It also follows each sent tensor until it is freed: `send_bytes_peak` is the
  most bytes of sent tensors alive at once, per group, whoever holds them.
- `problems(recordings)` pairs every send with its receive (per group, sender and receiver, in
  order: each is a FIFO) and lists each pair issued differently (batched vs plain), each shape
  or dtype mismatch, each op left unpaired, and each group whose first batched call (when it is
  the group's first operation) is not joined by all its ranks.
"""

from __future__ import annotations

import inspect
import weakref
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

COLLECTIVES = (
    "all_reduce", "broadcast", "barrier", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all_single", "reduce", "all_gather_object", "broadcast_object_list",
)  # fmt: skip


@dataclass(frozen=True)
class Op:
    """One tensor sent or received, or one collective, as rank `rank` issued it."""

    rank: int  # the issuing rank (global)
    seq: int  # its position in that rank's recording
    kind: str  # "send" | "recv" | "collective"
    group: str  # the group's name (the same on every rank)
    group_ranks: tuple[int, ...]
    batched: bool  # inside a batch_isend_irecv
    call: int  # the call it belongs to: a batch holds several ops
    peer: int | None = None  # global rank; None: a receive from any source
    shape: tuple[int, ...] = ()
    dtype: str = ""
    name: str = ""  # the collective's


class _Recording:
    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.calls = 0
        self.depth = 0  # inside a recorded call: what it calls is not recorded again
        self.live: dict[str, int] = defaultdict(int)  # bytes of sent tensors alive, per group
        self.peak: dict[str, int] = defaultdict(int)


_rec = _Recording()


def _group_of(group: Any) -> tuple[str, tuple[int, ...], Any]:
    group = group if group is not None else dist.group.WORLD
    return group.group_name, tuple(dist.get_process_group_ranks(group)), group


def _add(kind: str, group: Any, batched: bool, call: int, peer: int | None, tensor: torch.Tensor) -> None:
    name, ranks, _ = _group_of(group)
    shape, dtype = tuple(tensor.shape), str(tensor.dtype)
    _rec.ops.append(Op(dist.get_rank(), len(_rec.ops), kind, name, ranks, batched, call, peer, shape, dtype))
    if kind == "send":  # follow the tensor until nothing (Python or C++) holds it
        nbytes = tensor.numel() * tensor.element_size()
        _rec.live[name] += nbytes
        _rec.peak[name] = max(_rec.peak[name], _rec.live[name])
        weakref.finalize(tensor, _freed, name, nbytes)


def _freed(name: str, nbytes: int) -> None:
    _rec.live[name] -= nbytes


def _peer(group: Any, peer: int | None, group_peer: int | None) -> int | None:
    if group_peer is not None:
        return dist.get_global_rank(_group_of(group)[2], group_peer)
    return peer


def _wrap_p2p(kind: str, original: Callable) -> Callable:
    signature = inspect.signature(original)
    peer_name = "dst" if kind == "send" else "src"

    def recorded(*args: Any, **kwargs: Any) -> Any:
        _rec.depth += 1
        try:  # recv is irecv + wait, and a batch calls isend / irecv: recorded once, by the outermost
            out = original(*args, **kwargs)
        finally:
            _rec.depth -= 1
        if _rec.depth == 0:
            a = signature.bind(*args, **kwargs).arguments
            peer = _peer(a.get("group"), a.get(peer_name), a.get(f"group_{peer_name}"))
            if kind == "recv" and peer is None and isinstance(out, int):
                peer = out  # a blocking recv from any source returns the sender
            _rec.calls += 1
            _add(kind, a.get("group"), False, _rec.calls, peer, a["tensor"])
        return out

    recorded.__wrapped__ = original  # type: ignore[attr-defined]
    return recorded


def _wrap_batch(original: Callable, isends: tuple[Callable, ...]) -> Callable:
    def recorded(p2p_op_list: list) -> Any:
        _rec.calls += 1
        for op in p2p_op_list:
            kind = "send" if op.op in isends else "recv"
            _add(kind, op.group, True, _rec.calls, op.peer, op.tensor)
        _rec.depth += 1
        try:
            return original(p2p_op_list)
        finally:
            _rec.depth -= 1

    return recorded


def _wrap_collective(name: str, original: Callable) -> Callable:
    signature = inspect.signature(original)

    def recorded(*args: Any, **kwargs: Any) -> Any:
        group = signature.bind(*args, **kwargs).arguments.get("group")
        group_name, ranks, _ = _group_of(group)
        _rec.calls += 1
        _rec.ops.append(
            Op(dist.get_rank(), len(_rec.ops), "collective", group_name, ranks, False, _rec.calls, name=name)
        )
        return original(*args, **kwargs)

    return recorded


def install() -> None:
    """Record this process's point-to-point operations and collectives from now on (once per
    process: the rank workers are fresh processes)."""
    if getattr(dist.isend, "__wrapped__", None) is not None:
        return
    isend, irecv = _wrap_p2p("send", c10d.isend), _wrap_p2p("recv", c10d.irecv)
    for module in (dist, c10d):  # P2POp checks its op against c10d's isend / irecv
        module.isend, module.irecv = isend, irecv
    dist.send, dist.recv = _wrap_p2p("send", c10d.send), _wrap_p2p("recv", c10d.recv)
    dist.batch_isend_irecv = _wrap_batch(c10d.batch_isend_irecv, (isend, isend.__wrapped__))
    for name in COLLECTIVES:
        setattr(dist, name, _wrap_collective(name, getattr(c10d, name)))


def recording() -> list[Op]:
    return list(_rec.ops)


def send_bytes_peak() -> dict[str, int]:
    """The most bytes of sent tensors alive at once, per group name."""
    return dict(_rec.peak)


# ---- the checker -----------------------------------------------------------------------------
def problems(recordings: Sequence[Sequence[Op]]) -> list[str]:
    """Every way the ranks' recordings break NCCL's point-to-point rules (empty: none)."""
    ops = [op for rec in recordings for op in rec]
    out: list[str] = []
    sends: dict[tuple, list[Op]] = defaultdict(list)
    recvs: dict[tuple, list[Op]] = defaultdict(list)
    for op in ops:
        if op.kind == "send":
            sends[(op.group, op.rank, op.peer)].append(op)
        elif op.kind == "recv" and op.peer is None:
            out.append(f"rank {op.rank} op {op.seq}: a receive from any source (NCCL needs the sender named)")
        elif op.kind == "recv":
            recvs[(op.group, op.peer, op.rank)].append(op)
    partner: dict[tuple[int, int], Op] = {}
    for key in sorted(set(sends) | set(recvs)):
        group, src, dst = key
        s_ops, r_ops = sends.get(key, []), recvs.get(key, [])
        for k, (s, r) in enumerate(zip(s_ops, r_ops, strict=False)):  # the rest: unpaired
            partner[(s.rank, s.seq)], partner[(r.rank, r.seq)] = r, s
            where = f"group {group}, message {k} from rank {src} to rank {dst}"
            if s.batched != r.batched:
                out.append(
                    f"{where}: sent {_how(s)} but received {_how(r)} (NCCL runs the two on different "
                    "communicators: they never meet)"
                )
            if (s.shape, s.dtype) != (r.shape, r.dtype):
                out.append(f"{where}: sent {s.shape} {s.dtype}, received into {r.shape} {r.dtype}")
        out += [
            f"group {group}: rank {src}'s send (op {s.seq}) to rank {dst} is never received"
            for s in s_ops[len(r_ops) :]
        ]
        out += [
            f"group {group}: rank {dst}'s receive (op {r.seq}) from rank {src} is never sent"
            for r in r_ops[len(s_ops) :]
        ]
    return out + _first_calls(ops, partner)


def _how(op: Op) -> str:
    return "in a batch_isend_irecv" if op.batched else f"as a plain {'send' if op.kind == 'send' else 'recv'}"


def _first_calls(ops: list[Op], partner: dict[tuple[int, int], Op]) -> list[str]:
    """Per group carrying point-to-point traffic: each rank's first operation there that starts
    the group (a collective or a batched call; NCCL runs plain send/recv elsewhere). Either every
    rank's is a collective, or every rank's is a batched call and these calls only meet each other."""
    first: dict[str, dict[int, Op]] = defaultdict(dict)
    ranks: dict[str, tuple[int, ...]] = {}
    for op in sorted(ops, key=lambda o: (o.rank, o.seq)):
        ranks[op.group] = op.group_ranks
        if op.kind == "collective" or op.batched:
            first[op.group].setdefault(op.rank, op)
    out = []
    for group in sorted({op.group for op in ops if op.kind != "collective"}):
        mine = first.get(group, {})
        if all(op.kind == "collective" for op in mine.values()) and set(mine) == set(ranks[group]):
            continue
        starters = sorted(r for r, op in mine.items() if op.kind != "collective")
        if not starters:
            continue  # plain send/recv only: NCCL never builds this group's communicator for them
        absent = [r for r in ranks[group] if r not in mine or mine[r].kind == "collective"]
        if absent:
            out.append(
                f"group {group} (ranks {list(ranks[group])}): its first batched call (ranks {starters}) "
                f"is not joined by rank(s) {absent}"
            )
            continue
        for op in ops:
            if op.group == group and op.kind != "collective" and op.call == mine[op.rank].call:
                other = partner.get((op.rank, op.seq))
                if other is not None and other.call != mine[other.rank].call:
                    out.append(
                        f"group {group} (ranks {list(ranks[group])}): rank {op.rank}'s first batched call "
                        f"meets rank {other.rank}'s call {other.call}, not its first: not every rank joins it"
                    )
    return out


def assert_nccl_safe(recordings: Sequence[Sequence[Op]]) -> None:
    found = problems(recordings)
    if found:
        shown = "\n  ".join(found[:12])
        raise AssertionError(f"{len(found)} point-to-point problem(s) NCCL would hang on:\n  {shown}")
