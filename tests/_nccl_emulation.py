"""Records what each rank issues on its device process groups, and replays it by NCCL's rules.

The tests run on gloo, which forgives what NCCL does not. Under NCCL (torch's ProcessGroupNCCL,
``device_id`` bound: every op of a group runs on that group's one communicator):

1. the ops of one communicator run one after the other, in issue order: one that cannot finish
   blocks all queued behind it. A batched call and a collective use the group's communicator, a
   plain ``send``/``recv`` a separate one per pair of ranks (``isP2POp(opType, batchP2P)``);
2. ``batch_isend_irecv`` is one grouped op: it finishes once every peer's op holding the matching
   receive/send has started (modelled strictly: a send waits for its receiver whatever its size);
3. an op's stream waits for the compute stream when issued, and ``work.wait()`` makes the compute
   stream wait for the op: an op issued after ``wait(X)`` cannot start before X finishes;
4. a collective finishes once every rank of the group has started the matching one (matched by
   position among the group's collectives; name, shape and dtype must agree).

`install()` (in each rank, before any group exists) wraps ``torch.distributed``'s point-to-point
calls, collectives and ``new_group`` and appends one `Op` per call, in issue order, plus a
``wait`` Op whenever the issuing thread waits on a returned Work. Groups created with an explicit
``backend="gloo"`` stay on the host under NCCL too: they are not recorded. `nccl_problems` checks
the recordings of one world: the pairing of sends with receives (FIFO per group, sender and
receiver), the collectives' agreement, and `deadlocks` (a replay of rules 1-4 to a fixpoint).
`install_from_env` is the hook of ``_nccl_site/sitecustomize.py`` for processes a test launches.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import os
import pickle
import sys
import threading
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

ENV = "NANOLIGHT_NCCL_RECORD"  # a directory: processes started with it write their rank's recording
COLLECTIVES = (
    "all_gather", "all_gather_coalesced", "all_gather_into_tensor", "all_gather_object", "all_gather_single",
    "all_reduce", "all_reduce_coalesced", "all_to_all", "all_to_all_single", "barrier", "broadcast",
    "broadcast_object_list", "gather", "gather_object", "reduce", "reduce_scatter", "reduce_scatter_single",
    "reduce_scatter_tensor", "scatter", "scatter_object_list",
)  # fmt: skip
UNEVEN = ("all_to_all_single",)  # shapes may differ across ranks


@dataclass(frozen=True)
class Msg:
    """One tensor of a point-to-point op."""

    send: bool
    peer: int | None  # global rank; None: a receive from any source
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class Op:
    """One call as rank `rank` issued it, `seq`-th in its recording."""

    rank: int
    seq: int
    kind: str  # "batch" | "send" | "recv" (plain) | "collective" | "wait"
    group: str = ""
    group_ranks: tuple[int, ...] = ()
    msgs: tuple[Msg, ...] = ()  # batch / send / recv
    name: str = ""  # a collective's
    shape: tuple[int, ...] | None = None  # a collective's tensor (None: none, or a list)
    dtype: str = ""
    target: int = -1  # a wait's: the seq of the op waited for


class _Recording:
    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.depth = 0  # inside a recorded call: what it calls is not recorded again
        self.host_groups: set[str] = set()  # created with backend="gloo": not device groups
        self.world: tuple[str, int, int] | None = None  # (run key, rank, size) once the world ended cleanly
        self.failed = False  # an uncaught exception ended the process


_rec = _Recording()


class _Work:
    """A Work whose ``wait()`` by the issuing thread is recorded (other threads' are gloo's own)."""

    def __init__(self, work: Any, seq: int) -> None:
        self._work, self._seq, self._thread = work, seq, threading.get_ident()

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == self._thread:
            _append("wait", target=self._seq)
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _append(kind: str, **fields: Any) -> int:
    seq = len(_rec.ops)
    _rec.ops.append(Op(dist.get_rank(), seq, kind, **fields))
    return seq


def _group(group: Any) -> tuple[str, tuple[int, ...], Any] | None:
    """(name, global ranks, group), or None for a host (explicitly gloo) group."""
    group = group if group is not None else dist.group.WORLD
    if group.group_name in _rec.host_groups:
        return None
    return group.group_name, tuple(dist.get_process_group_ranks(group)), group


def _msg(send: bool, group: Any, peer: int | None, group_peer: int | None, tensor: torch.Tensor) -> Msg:
    if group_peer is not None:
        peer = dist.get_global_rank(group, group_peer)
    return Msg(send, peer, tuple(tensor.shape), str(tensor.dtype))


def _outermost(original: Callable, signature: inspect.Signature, args: tuple, kwargs: dict) -> tuple:
    """Call `original`; (its result, its bound arguments, its group's `_group`), the last two None
    when it is not to be recorded: called from inside another recorded call (recv is irecv +
    wait, a batch calls isend / irecv: recorded once, by the outermost) or on a host group."""
    _rec.depth += 1
    try:
        out = original(*args, **kwargs)
    finally:
        _rec.depth -= 1
    a = signature.bind(*args, **kwargs).arguments
    where = None if _rec.depth else _group(a.get("group"))
    return out, a, where


def _wrap_p2p(kind: str, original: Callable, blocking: bool) -> Callable:
    signature = inspect.signature(original)
    peer_name = "dst" if kind == "send" else "src"

    def recorded(*args: Any, **kwargs: Any) -> Any:
        out, a, where = _outermost(original, signature, args, kwargs)
        if where is None:
            return out
        peer = a.get(peer_name)
        if kind == "recv" and peer is None and a.get("group_src") is None and isinstance(out, int):
            peer = out  # a blocking recv from any source returns the sender
        msg = _msg(kind == "send", where[2], peer, a.get(f"group_{peer_name}"), a["tensor"])
        seq = _append(kind, group=where[0], group_ranks=where[1], msgs=(msg,))
        if blocking:
            _append("wait", target=seq)
            return out
        return _Work(out, seq) if out is not None else out

    return functools.update_wrapper(recorded, original)


def _wrap_batch(original: Callable, isends: tuple[Callable, ...]) -> Callable:
    def recorded(p2p_op_list: list) -> Any:
        _rec.depth += 1
        try:
            works = original(p2p_op_list)
        finally:
            _rec.depth -= 1
        where = _group(p2p_op_list[0].group)
        if _rec.depth or where is None:
            return works
        msgs = tuple(
            Msg(op.op in isends, op.peer, tuple(op.tensor.shape), str(op.tensor.dtype)) for op in p2p_op_list
        )
        seq = _append("batch", group=where[0], group_ranks=where[1], msgs=msgs)
        return [_Work(w, seq) for w in works]

    return functools.update_wrapper(recorded, original)  # its name too: code may look at it


def _wrap_collective(name: str, original: Callable) -> Callable:
    signature = inspect.signature(original)

    def recorded(*args: Any, **kwargs: Any) -> Any:
        out, a, where = _outermost(original, signature, args, kwargs)
        if where is None:
            return out
        tensor = next(
            (a[k] for k in ("tensor", "input_tensor", "input") if isinstance(a.get(k), torch.Tensor)), None
        )
        shape, dtype = (tuple(tensor.shape), str(tensor.dtype)) if tensor is not None else (None, "")
        seq = _append("collective", group=where[0], group_ranks=where[1], name=name, shape=shape, dtype=dtype)
        if out is None:  # blocking (async_op=False): issued, then waited for
            _append("wait", target=seq)
            return out
        return _Work(out, seq)

    return functools.update_wrapper(recorded, original)  # its name too: code may look at it


def _wrap_new_group(original: Callable) -> Callable:
    signature = inspect.signature(original)

    def recorded(*args: Any, **kwargs: Any) -> Any:
        group = original(*args, **kwargs)
        backend = signature.bind(*args, **kwargs).arguments.get("backend")
        if (
            backend is not None
            and str(backend).lower() == "gloo"
            and group not in (None, c10d.GroupMember.NON_GROUP_MEMBER)
        ):
            _rec.host_groups.add(group.group_name)  # stays on the host under NCCL too
        return group

    return functools.update_wrapper(recorded, original)  # its name too: code may look at it


def _wrap_destroy(original: Callable) -> Callable:
    def recorded(group: Any = None) -> Any:
        if group is None and dist.is_initialized() and threading.current_thread() is threading.main_thread():
            key = f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}:{os.getppid()}"
            _rec.world = (key, dist.get_rank(), dist.get_world_size())
        return original(group)

    return functools.update_wrapper(recorded, original)  # its name too: code may look at it


def install() -> None:
    """Record this process's device-group operations from now on (idempotent). Must run before
    any group is created (so that explicitly gloo groups are known) and before code binds
    ``torch.distributed``'s functions to names of its own."""
    if getattr(dist.isend, "__wrapped__", None) is not None:
        return
    isend, irecv = _wrap_p2p("send", c10d.isend, False), _wrap_p2p("recv", c10d.irecv, False)
    for module in (dist, c10d):  # P2POp and batch_isend_irecv compare an op with c10d's isend / irecv
        module.isend, module.irecv = isend, irecv
    dist.send, dist.recv = _wrap_p2p("send", c10d.send, True), _wrap_p2p("recv", c10d.recv, True)
    dist.batch_isend_irecv = _wrap_batch(c10d.batch_isend_irecv, (isend, isend.__wrapped__))
    for name in COLLECTIVES:
        setattr(dist, name, _wrap_collective(name, getattr(c10d, name)))
    dist.new_group = _wrap_new_group(c10d.new_group)
    dist.destroy_process_group = _wrap_destroy(c10d.destroy_process_group)


def installed() -> bool:
    return getattr(dist.isend, "__wrapped__", None) is not None


def recording() -> list[Op]:
    return list(_rec.ops)


def take_recording() -> list[Op]:
    """This process's recording so far, and a fresh one from here: a process that plays several
    ranks in turn (the dry run's fake world, one role at a time) takes each rank's in turn."""
    ops, _rec.ops = _rec.ops, []
    return ops


# ---- processes a test launches (``_nccl_site/sitecustomize.py``) ------------------------------
def install_from_env() -> None:
    """With $NANOLIGHT_NCCL_RECORD set: record, and at a clean end of a rank (the world destroyed
    by the main thread, no uncaught exception nor ``sys.exit`` with an error) write its recording
    there, at exit, for the test to check."""
    if not os.environ.get(ENV):
        return
    install()
    hook, pid = sys.excepthook, os.getpid()

    def excepthook(*args: Any) -> None:
        _rec.failed = True
        hook(*args)

    sys.excepthook = excepthook
    exit_ = sys.exit

    def exit(status: object = None) -> None:  # noqa: A001 - sys.exit(1) after an error is no clean end
        _rec.failed = _rec.failed or status not in (None, 0)
        exit_(status)

    sys.exit = exit
    atexit.register(_write, Path(os.environ[ENV]), pid)


def _write(directory: Path, pid: int) -> None:
    if os.getpid() != pid or _rec.world is None or _rec.failed:
        return  # a forked child, a process without a world, or one that raised
    key, rank, size = _rec.world
    safe = "".join(c if c.isalnum() else "_" for c in key)
    path = directory / f"{safe}-rank{rank}.pkl"
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps({"key": key, "rank": rank, "world_size": size, "ops": _rec.ops}))
    tmp.rename(path)


def recorded_worlds(directory: Path) -> dict[str, list[list[Op]]]:
    """The recordings under `directory` of each world all of whose ranks wrote one."""
    worlds: dict[str, dict[int, dict]] = defaultdict(dict)
    for path in sorted(directory.glob("*.pkl")):
        data = pickle.loads(path.read_bytes())
        worlds[data["key"]][data["rank"]] = data
    complete = {}
    for key, ranks in worlds.items():
        size = next(iter(ranks.values()))["world_size"]
        if sorted(ranks) == list(range(size)):
            complete[key] = [ranks[r]["ops"] for r in range(size)]
    return complete


# ---- pairing -------------------------------------------------------------------------------
_Ref = tuple[int, int]  # (rank, seq) of an op


def _pairs(recordings: Sequence[Sequence[Op]]) -> tuple[list[tuple[Op, Op]], list[str]]:
    """Each send with its receive (FIFO per group, sender and receiver), and the problems found
    (a batched send with a plain receive is a pair that never meets)."""
    sends: dict[tuple, list[tuple[Op, Msg]]] = defaultdict(list)
    recvs: dict[tuple, list[tuple[Op, Msg]]] = defaultdict(list)
    out: list[str] = []
    for op in (op for rec in recordings for op in rec if op.msgs):
        for m in op.msgs:
            if m.send:
                sends[(op.group, op.rank, m.peer)].append((op, m))
            elif m.peer is None:
                out.append(
                    f"rank {op.rank} op {op.seq}: a receive from any source (NCCL needs the sender named)"
                )
            else:
                recvs[(op.group, m.peer, op.rank)].append((op, m))
    pairs = []
    for key in sorted(set(sends) | set(recvs), key=str):
        group, src, dst = key
        s_list, r_list = sends.get(key, []), recvs.get(key, [])
        for k, ((s, sm), (r, rm)) in enumerate(zip(s_list, r_list, strict=False)):
            where = f"group {group}, message {k} from rank {src} to rank {dst}"
            if (s.kind == "batch") != (r.kind == "batch"):
                out.append(
                    f"{where}: sent {_how(s)} but received {_how(r)} (NCCL runs the two on different "
                    "communicators: they never meet)"
                )
            pairs.append((s, r))
            if (sm.shape, sm.dtype) != (rm.shape, rm.dtype):
                out.append(f"{where}: sent {sm.shape} {sm.dtype}, received into {rm.shape} {rm.dtype}")
        out += [
            f"group {group}: rank {src}'s send (op {s.seq}) to rank {dst} is never received"
            for s, _ in s_list[len(r_list) :]
        ]
        out += [
            f"group {group}: rank {dst}'s receive (op {r.seq}) from rank {src} is never sent"
            for r, _ in r_list[len(s_list) :]
        ]
    return pairs, out


def _how(op: Op) -> str:
    return "in a batch_isend_irecv" if op.kind == "batch" else f"as a plain {op.kind}"


def _first_calls(recordings: Sequence[Sequence[Op]], pairs: list[tuple[Op, Op]]) -> list[str]:
    """torch's rule for a group whose first op is a batched call: every rank joins that call, and
    those calls only meet each other. (A collective first on every rank lifts it.)"""
    first: dict[str, dict[int, Op]] = defaultdict(dict)
    ranks: dict[str, tuple[int, ...]] = {}
    for op in (op for rec in recordings for op in rec if op.kind in ("batch", "collective")):
        ranks[op.group] = op.group_ranks
        first[op.group].setdefault(op.rank, op)
    out = []
    for group, mine in sorted(first.items()):
        starters = sorted(r for r, op in mine.items() if op.kind == "batch")
        if not starters:
            continue
        absent = [r for r in ranks[group] if r not in mine or mine[r].kind != "batch"]
        if absent:
            out.append(
                f"group {group} (ranks {list(ranks[group])}): its first batched call (ranks {starters}) "
                f"is not joined by rank(s) {absent}"
            )
            continue
        for s, r in pairs:
            for op, other in ((s, r), (r, s)):
                if op.group == group and op is mine[op.rank] and other is not mine[other.rank]:
                    out.append(
                        f"group {group} (ranks {list(ranks[group])}): rank {op.rank}'s first batched call "
                        f"meets rank {other.rank}'s op {other.seq}, not its first: not every rank joins it"
                    )
    return sorted(set(out))


def _collectives(recordings: Sequence[Sequence[Op]]) -> tuple[dict[_Ref, list[_Ref | None]], list[str]]:
    """Each collective with the ones it matches on the other ranks of its group (None: a rank
    that never issues it), and each disagreement in name, shape or dtype."""
    per: dict[tuple[str, int], list[Op]] = defaultdict(list)
    for op in (op for rec in recordings for op in rec if op.kind == "collective"):
        per[(op.group, op.rank)].append(op)
    matches: dict[_Ref, list[_Ref | None]] = {}
    out = []
    for (group, rank), ops in per.items():
        for i, op in enumerate(ops):
            theirs = [per.get((group, r), []) for r in op.group_ranks]
            others = [ops_r[i] if i < len(ops_r) else None for ops_r in theirs]
            matches[(rank, op.seq)] = [(o.rank, o.seq) if o is not None else None for o in others]
            if next(o for o in others if o is not None) is not op:
                continue  # reported by the first rank that issues it
            for o in (o for o in others if o is not None):
                if not _agree(op, o):
                    out.append(
                        f"group {group}: collective {i} differs: rank {op.rank} issues {_describe(op)}, "
                        f"rank {o.rank} {_describe(o)}"
                    )
    return matches, out


def _agree(a: Op, b: Op) -> bool:
    same_shape = a.name in UNEVEN or a.shape is None or b.shape is None or a.shape == b.shape
    return (a.name, a.dtype) == (b.name, b.dtype) and same_shape


# ---- order -------------------------------------------------------------------------------
def _channel(op: Op) -> tuple:
    """The communicator an op runs on (rule 1)."""
    if op.kind in ("send", "recv"):
        pair = sorted((op.rank, op.msgs[0].peer if op.msgs[0].peer is not None else -1))
        return (op.group, *pair)
    return (op.group,)


def deadlocks(recordings: Sequence[Sequence[Op]]) -> list[str]:
    """Replay the ranks' recordings by rules 1-4; one line per op that stays stuck at the head of
    its communicator, with what it waits for (empty: every op finishes)."""
    ops = {(op.rank, op.seq): op for rec in recordings for op in rec}
    pairs, _ = _pairs(recordings)
    matches, _ = _collectives(recordings)
    needs: dict[_Ref, list[_Ref | None]] = defaultdict(list)  # ops that must start before this one finishes
    for s, r in (p for p in pairs if (p[0].kind == "batch") == (p[1].kind == "batch")):  # else: never meet
        needs[(s.rank, s.seq)].append((r.rank, r.seq))
        needs[(r.rank, r.seq)].append((s.rank, s.seq))
    for ref, others in matches.items():
        needs[ref] += [o for o in others if o != ref]
    for ref, op in ops.items():  # a message never paired: its op never finishes
        if len(op.msgs) > len(needs[ref]):
            needs[ref].append(None)
    watchers: dict[int, set[int]] = defaultdict(set)  # rank -> ranks whose ops need one of its ops
    for ref, others in needs.items():
        for o in others:
            if o is not None:
                watchers[o[0]].add(ref[0])

    queues: dict[int, dict[tuple, deque[Op]]] = defaultdict(lambda: defaultdict(deque))
    waits: dict[int, deque[Op]] = defaultdict(deque)
    for rec in recordings:
        for op in rec:
            (waits[op.rank] if op.kind == "wait" else queues[op.rank][_channel(op)]).append(op)
    started: set[_Ref] = set()
    finished: set[_Ref] = set()

    def bound(rank: int) -> int:  # ops issued after the first unfinished wait cannot start (rule 3)
        pending = waits[rank]
        while pending and (rank, pending[0].target) in finished:
            pending.popleft()
        return pending[0].seq if pending else sys.maxsize

    work = deque(sorted(queues))
    while work:
        rank = work.popleft()
        progress = True
        while progress:
            progress = False
            for queue in queues[rank].values():
                while queue:
                    head, ref = queue[0], (rank, queue[0].seq)
                    if ref not in started and head.seq < bound(rank):
                        started.add(ref)
                        work.extend(r for r in watchers[rank] if r not in work and r != rank)
                    if ref in started and all(o is not None and o in started for o in needs[ref]):
                        finished.add(ref)
                        queue.popleft()
                        progress = True
                    else:
                        break
    out = []
    for rank in sorted(queues):
        for queue in queues[rank].values():
            if queue:
                head = queue[0]
                out.append(
                    f"deadlock: rank {rank} {_describe(head)} (op {head.seq}) {_why(head, bound(rank), needs, started, ops)}"
                )
    return sorted(out, key=lambda line: "never starts" in line)  # the cycle's ops first, then those behind it


def _describe(op: Op) -> str:
    if op.kind == "collective":
        what = "" if op.shape is None else f" {op.shape} {op.dtype}"
        return f"on group {op.group}: {op.name}{what}"
    msgs = ", ".join(f"{'send→' if m.send else 'recv←'}{m.peer} {m.shape}" for m in op.msgs)
    return f"on group {op.group}: {'batch' if op.kind == 'batch' else 'plain'}[{msgs}]"


def _why(op: Op, bound: int, needs: dict, started: set[_Ref], ops: dict[_Ref, Op]) -> str:
    if (op.rank, op.seq) not in started:
        return f"never starts: issued after a wait (op {bound}) for an op that never finishes"
    missing = [o for o in needs[(op.rank, op.seq)] if o is None or o not in started]
    said = [
        "a matching op that is never issued"
        if o is None
        else f"rank {o[0]}'s op {o[1]} ({_describe(ops[o])})"
        for o in missing
    ]
    return "started, waits for " + "; ".join(dict.fromkeys(said)) + " to start"


def nccl_problems(recordings: Sequence[Sequence[Op]]) -> list[str]:
    """Every way one world's recordings break NCCL's rules (empty: none)."""
    pairs, out = _pairs(recordings)
    out += _first_calls(recordings, pairs)
    out += _collectives(recordings)[1]
    return out + deadlocks(recordings)


def assert_nccl_safe(recordings: Sequence[Sequence[Op]]) -> None:
    found = nccl_problems(recordings)
    if found:
        shown = "\n  ".join(found[:16])
        raise AssertionError(
            f"{len(found)} problem(s) NCCL would hang on (tests/_nccl_emulation.py):\n  {shown}"
        )
