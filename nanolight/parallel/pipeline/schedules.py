"""Pipeline schedules: the order in which one stage runs forwards (F) and backwards (B).

A schedule is plain data, built per stage, so it can be printed, tested and reasoned about
without processes: a list of (F | B, micro-batch i, local chunk c). Without virtual stages every
rank holds one chunk (c = 0); with interleaved 1F1B a rank holds v chunks and the list holds v
forwards and v backwards per micro-batch. `stage_program` adds the exchanges between the
actions; the stage runs that program (`runner.py`) and hands the trainer micro-batch i's
training_step at its first chunk forward (where the stage needs the arguments the user's
``training_step`` passes to the model) and its backward at its first chunk backward (where the
stage needs the loss to back-propagate). The exchanges make the stages wait for each other, so
the per-stage lists together form the pipeline. Without pipeline parallelism the schedule is
`one_by_one`: plain gradient accumulation.

With p stages and m micro-batches AFAB and 1F1B leave the same idle "bubble" of
(p-1)/(m+p-1) of the step; they differ in memory. All-forward-all-backward (GPipe) keeps the
activations of all m micro-batches alive on every stage; 1F1B starts each micro-batch's
backward as soon as possible, so stage s never holds more than p-s (<= p) of them.
Interleaved 1F1B (Megatron-LM's virtual pipeline) gives each rank v non-adjacent chunks of
layers (chunk c of rank r is virtual stage c*p + r): a micro-batch goes round the ring of ranks
v times, each pass 1/v of the work, so the fill and drain shrink to (p-1)/(v*m+p-1) of the step,
for v times as many messages and a few more live activations (`max_in_flight`).
"""

from __future__ import annotations

from dataclasses import dataclass

from nanolight.errors import UsageError

FORWARD, BACKWARD = "F", "B"
Action = tuple[str, int]  # (kind, micro-batch): a one-chunk schedule; what the trainer is handed
ChunkAction = tuple[str, int, int]  # (kind, micro-batch, local chunk)
SCHEDULES = ("1f1b", "afab", "interleaved_1f1b")


def one_by_one(num_micro_batches: int) -> list[Action]:
    """Gradient accumulation on one stage: each micro-batch's forward, then its backward."""
    return [(kind, i) for i in range(num_micro_batches) for kind in (FORWARD, BACKWARD)]


def all_forward_all_backward(num_micro_batches: int) -> list[Action]:
    """GPipe: every forward, then every backward (in the same order)."""
    m = num_micro_batches
    warmup = [(FORWARD, i) for i in range(m)]  # warm-up: fill the pipeline with all m micro-batches
    steady: list[Action] = []  # no steady phase: nothing overlaps forwards with backwards
    cooldown = [(BACKWARD, i) for i in range(m)]  # cool-down: drain every micro-batch's backward
    return warmup + steady + cooldown


def one_forward_one_backward(num_micro_batches: int, pp_size: int, pp_rank: int) -> list[Action]:
    """1F1B (PipeDream-Flush): warm up with a few forwards, then alternate, then drain.

    Stage s runs p-s-1 warm-up forwards: exactly enough that when the last stage finishes its
    first forward (and immediately its backward), gradient 0 reaches stage s just as s is ready
    for it. From then on each stage does one forward and one backward per micro-batch, so at
    most p-s micro-batches are in flight on stage s.
    """
    m = num_micro_batches
    num_warmup = min(pp_size - pp_rank - 1, m)
    num_steady = m - num_warmup

    # Warm-up: forwards only, filling the pipeline downstream of this stage.
    schedule: list[Action] = [(FORWARD, i) for i in range(num_warmup)]
    # Steady state: forward micro-batch (warm-up + k), then backward the oldest one in flight (k).
    for k in range(num_steady):
        schedule.append((FORWARD, num_warmup + k))
        schedule.append((BACKWARD, k))
    # Cool-down: no forwards left; backward the micro-batches still in flight, oldest first.
    schedule += [(BACKWARD, i) for i in range(num_steady, m)]
    return schedule


def interleaved_1f1b(num_micro_batches: int, pp_size: int, pp_rank: int, virtual: int) -> list[ChunkAction]:
    """Interleaved 1F1B (Megatron-LM's schedule for virtual pipeline stages), rank `pp_rank`'s list.

    The rank's m*v chunk forwards run in a fixed order: micro-batches in groups of p; within a
    group, chunk 0 for the p micro-batches, then chunk 1 for the same p, ... (their output comes
    back round the ring of p ranks just as the rank gets to them); the backwards run in the same
    order with the chunks reversed. 1F1B is then applied to these m*v units of work. Needs m to
    be a multiple of p (`check_micro_batches`).
    """
    m, p, v = num_micro_batches, pp_size, virtual
    total = m * v  # this rank's chunk forwards in the step (and as many backwards)

    def unit(k: int, kind: str) -> ChunkAction:
        """The rank's k-th chunk forward (or backward): which micro-batch, which chunk."""
        group, within = divmod(k, p * v)
        step, lane = divmod(within, p)
        return kind, group * p + lane, step if kind == FORWARD else v - 1 - step

    # Warm-up: forwards only. (v-1)*p of them let the first micro-batch reach this rank's last
    # chunk; 2*(p-r-1) more keep rank r busy until the first gradient comes back from downstream.
    num_warmup = min(total, 2 * (p - pp_rank - 1) + (v - 1) * p)
    schedule = [unit(k, FORWARD) for k in range(num_warmup)]
    # Steady state: the next chunk forward, then the oldest chunk backward in flight.
    for k in range(total - num_warmup):
        schedule += [unit(num_warmup + k, FORWARD), unit(k, BACKWARD)]
    # Cool-down: no forwards left; the chunk backwards still in flight, oldest first.
    schedule += [unit(k, BACKWARD) for k in range(total - num_warmup, total)]
    return schedule


def check_micro_batches(pp: int, schedule: str, micro_batches: int) -> None:
    """1F1B needs at least pp micro-batches per step to reach its steady phase; interleaved
    1F1B runs them in groups of pp. Say so clearly."""
    m = micro_batches
    if pp > 1 and schedule == "1f1b" and m < pp:
        raise UsageError(
            f"the 1F1B schedule needs at least pp={pp} micro-batches per optimizer step, got "
            f"accumulate_grad_batches={m}: with fewer, stages idle most of the step "
            f"(bubble (p-1)/(m+p-1) = {(pp - 1) / (m + pp - 1):.0%}). Set "
            f"trainer.accumulate_grad_batches >= {pp} (4*pp or more keeps the bubble small) or "
            "use pp_schedule='afab'"
        )
    if pp > 1 and schedule == "interleaved_1f1b" and (m < pp or m % pp != 0):
        lower = m // pp * pp
        fix = f"{lower} or {lower + pp}" if lower >= pp else f"{pp}"
        raise UsageError(
            f"the interleaved 1F1B schedule needs the micro-batches per optimizer step to be a multiple of "
            f"pp={pp} (they go through each rank's chunks in groups of pp), got "
            f"accumulate_grad_batches={m}; set trainer.accumulate_grad_batches={fix}"
        )


def stage_schedule(
    name: str, num_micro_batches: int, pp_size: int, pp_rank: int, virtual: int = 1
) -> list[ChunkAction]:
    """Stage `pp_rank`'s chunk-level actions for one step (`check_micro_batches` says whether m suits p)."""
    if name == "interleaved_1f1b":
        return interleaved_1f1b(num_micro_batches, pp_size, pp_rank, virtual)
    if virtual != 1:
        raise UsageError(f"pp_virtual={virtual} needs pp_schedule='interleaved_1f1b', not {name!r}")
    if name == "1f1b":
        actions = one_forward_one_backward(num_micro_batches, pp_size, pp_rank)
    elif name == "afab":
        actions = all_forward_all_backward(num_micro_batches)
    else:
        raise UsageError(f"unknown pipeline schedule {name!r}; choose one of {SCHEDULES}")
    return [(kind, i, 0) for kind, i in actions]


def max_in_flight(schedule: list[Action] | list[ChunkAction]) -> int:
    """Most forwards not yet backwarded at once (activations kept alive): micro-batches, or chunk
    activations (each 1/v of the rank's layers) for a list with chunks."""
    live = peak = 0
    for kind, *_ in schedule:
        live += 1 if kind == FORWARD else -1
        peak = max(peak, live)
    return peak


def bubble_fraction(num_micro_batches: int, pp_size: int, virtual: int = 1) -> float:
    """Ideal idle fraction of a step for equal-cost stages: (p-1)/(v*m+p-1)."""
    return (pp_size - 1) / (virtual * num_micro_batches + pp_size - 1)


# ---- the exchange plan: when each message crosses between neighbours ---------------------------
#
# NCCL runs every operation of a communicator in the order the rank issued it, and a batched
# exchange finishes only when every send and receive in it has met the peer's. A stage that posts
# its receives "as early as it can" lets a later send queue behind its own receive while the peer's
# send queues behind *its* receive: a cycle (interleaving closes the ring, so one group carries
# both directions). The plan rules that out by construction. All ranks replay the same step on a
# clock (`_timeline`: a forward takes 1, a backward 2, each action as soon as its input exists)
# and every message is given the time its producer finishes. At that time the sender posts its
# send and the receiver its receive, each in one batch holding everything it exchanges at that
# time (Megatron's ``_communicate`` does the same). Every rank posts its batches in time order,
# and a batch meets only batches of the same time, so by induction on time every batch finishes:
# the ops issued before time t's batch wait only for batches of earlier times. The clock decides
# only the order of the batches, not when anything runs.

Message = tuple[str, int, int]  # (F: activation | B: its gradient, micro-batch, boundary b): b's input
COST = {FORWARD: 1, BACKWARD: 2}


@dataclass(frozen=True)
class Run:
    """Run one chunk action (receives it needs were posted by an earlier `Exchange`)."""

    action: ChunkAction


@dataclass(frozen=True)
class Exchange:
    """One batch with both neighbours at plan time `time`: what this rank sends and receives."""

    time: int
    sends: tuple[Message, ...]
    recvs: tuple[Message, ...]


Step = Run | Exchange


def stage_program(
    name: str, num_micro_batches: int, pp_size: int, pp_rank: int, virtual: int = 1
) -> list[Step]:
    """Rank `pp_rank`'s step: its chunk actions with the exchanges of the plan between them."""
    lists = [stage_schedule(name, num_micro_batches, pp_size, r, virtual) for r in range(pp_size)]
    return _program(lists, pp_size, virtual, pp_rank)


def forward_program(pp_size: int, pp_rank: int, virtual: int = 1) -> list[Step]:
    """One forward pass through every chunk (validation, inference), as a plan of one micro-batch."""
    lists = [[(FORWARD, 0, c) for c in range(virtual)] for _ in range(pp_size)]
    return _program(lists, pp_size, virtual, pp_rank)


def message_ranks(message: Message, pp_size: int) -> tuple[int, int]:
    """(sender, receiver) pipeline ranks of `message`: an activation goes from the rank of
    virtual stage b-1 to b's, its gradient back."""
    kind, _, b = message
    before, after = (b - 1) % pp_size, b % pp_size
    return (before, after) if kind == FORWARD else (after, before)


def _timeline(lists: list[list[ChunkAction]], p: int, v: int) -> dict[tuple[str, int, int], tuple[int, int]]:
    """(kind, micro-batch, virtual stage) -> (start, end) of every rank's actions on the clock."""
    last, times = p * v - 1, {}
    pos, free = [0] * p, [0] * p
    while any(pos[r] < len(lists[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while pos[r] < len(lists[r]):
                kind, i, c = lists[r][pos[r]]
                g = c * p + r
                if kind == FORWARD:
                    needs = (FORWARD, i, g - 1) if g > 0 else None
                else:
                    needs = (BACKWARD, i, g + 1) if g < last else (FORWARD, i, g)
                if needs is not None and needs not in times:
                    break  # its input comes from an action not placed yet
                start = max(free[r], times[needs][1] if needs else 0)
                free[r] = start + COST[kind]
                times[(kind, i, g)] = (start, free[r])
                pos[r] += 1
                moved = True
        if not moved:
            raise RuntimeError("the pipeline schedules wait for each other: no rank can run its next action")
    return times


def _program(lists: list[list[ChunkAction]], p: int, v: int, rank: int) -> list[Step]:
    last, times = p * v - 1, _timeline(lists, p, v)
    sends: dict[int, list[Message]] = {}
    recvs: dict[int, list[Message]] = {}
    for (kind, i, g), (_, end) in times.items():
        if kind == FORWARD and g < last:
            message: Message = (FORWARD, i, g + 1)  # g's output: g+1's input
        elif kind == BACKWARD and g > 0:
            message = (BACKWARD, i, g)  # the gradient of g's input, back to g-1
        else:
            continue
        sender, receiver = message_ranks(message, p)
        if sender == rank:
            sends.setdefault(end, []).append(message)
        if receiver == rank:
            recvs.setdefault(end, []).append(message)
    timed: list[tuple[int, int, Step]] = [
        (t, 0, Exchange(t, tuple(sorted(sends.get(t, ()))), tuple(sorted(recvs.get(t, ())))))
        for t in sorted(set(sends) | set(recvs))
    ]  # at equal times the exchange comes first: the action starting then may need what it receives
    timed += [(times[(kind, i, c * p + rank)][0], 1, Run((kind, i, c))) for kind, i, c in lists[rank]]
    return [step for _, _, step in sorted(timed, key=lambda x: (x[0], x[1]))]


def held_sends(program: list[Step], pp_size: int, pp_rank: int, virtual: int = 1) -> tuple[int, int, int]:
    """Rank `pp_rank` running `program`: the most activations and the most gradients held for sends
    at once, and the most sent tensors alive at once. A batch's sends are let go when the wait for a
    later receive completes it (every earlier batch with it), or before the action after next
    (`p2p.StageP2P`), the rest at the step's end; a sent activation is also the chunk's output,
    which lives on until that chunk's backward."""
    last = pp_size * virtual - 1
    posted: list[tuple[Message, ...]] = []  # per exchange: what it sent
    posted_at: dict[Message, int] = {}  # a receive -> its exchange
    done, before_last, peak = 0, 0, [0, 0, 0]
    held: set[Message] = set()  # sends whose batch is not complete
    kept: set[Message] = set()  # sent activations whose chunk has not run its backward
    for step in program:
        if isinstance(step, Exchange):
            posted.append(step.sends)
            held.update(step.sends)
            kept.update(m for m in step.sends if m[0] == FORWARD)
            posted_at.update((m, len(posted) - 1) for m in step.recvs)
        else:
            kind, i, c = step.action
            g = c * pp_size + pp_rank
            needs = (FORWARD, i, g) if kind == FORWARD and g > 0 else None
            needs = (BACKWARD, i, g + 1) if kind == BACKWARD and g < last else needs
            upto = max(before_last, posted_at[needs] + 1 if needs is not None else 0)
            before_last = len(posted)
            while done < upto:
                held.difference_update(posted[done])
                done += 1
            if kind == BACKWARD:
                kept.discard((FORWARD, i, g + 1))  # its output: freed with its backward
        counts = (sum(m[0] == FORWARD for m in held), sum(m[0] == BACKWARD for m in held), len(held | kept))
        peak = [max(a, b) for a, b in zip(peak, counts, strict=True)]
    return peak[0], peak[1], peak[2]
