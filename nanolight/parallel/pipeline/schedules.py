"""Pipeline schedules: the order in which one stage runs forwards (F) and backwards (B).

A schedule is plain data -- a list of (`FORWARD` | `BACKWARD`, micro-batch index) -- built per
stage, so it can be printed, tested and reasoned about without processes. The trainer walks it
(the strategy hands it over); the point-to-point exchanges inside F and B make the stages wait
for each other, so the per-stage lists together form the pipeline. Without pipeline parallelism
the schedule is `one_by_one`: plain gradient accumulation.

With p stages and m micro-batches both schedules leave the same idle "bubble" of
(p-1)/(m+p-1) of the step; they differ in memory. All-forward-all-backward (GPipe) keeps the
activations of all m micro-batches alive on every stage; 1F1B starts each micro-batch's
backward as soon as possible, so stage s never holds more than p-s (<= p) of them.
"""

from __future__ import annotations

from nanolight.errors import UsageError

FORWARD, BACKWARD = "F", "B"
Action = tuple[str, int]
SCHEDULES = ("1f1b", "afab")


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


def check_micro_batches(pp: int, schedule: str, micro_batches: int) -> None:
    """1F1B needs at least pp micro-batches per step to reach its steady phase; say so clearly."""
    if pp > 1 and schedule == "1f1b" and micro_batches < pp:
        raise UsageError(
            f"the 1F1B schedule needs at least pp={pp} micro-batches per optimizer step, got "
            f"accumulate_grad_batches={micro_batches}: with fewer, stages idle most of the step "
            f"(bubble (p-1)/(m+p-1) = {(pp - 1) / (micro_batches + pp - 1):.0%}). Set "
            f"trainer.accumulate_grad_batches >= {pp} (4*pp or more keeps the bubble small) or "
            "use pp_schedule='afab'"
        )


def build_schedule(name: str, num_micro_batches: int, pp_size: int, pp_rank: int) -> list[Action]:
    """Stage `pp_rank`'s actions for one step (`check_micro_batches` says whether m suits p)."""
    if name == "1f1b":
        return one_forward_one_backward(num_micro_batches, pp_size, pp_rank)
    if name == "afab":
        return all_forward_all_backward(num_micro_batches)
    raise UsageError(f"unknown pipeline schedule {name!r}; choose one of {SCHEDULES}")


def max_in_flight(schedule: list[Action]) -> int:
    """Most micro-batches forwarded but not yet backwarded at once (activations kept alive)."""
    live = peak = 0
    for kind, _ in schedule:
        live += 1 if kind == FORWARD else -1
        peak = max(peak, live)
    return peak


def bubble_fraction(num_micro_batches: int, pp_size: int) -> float:
    """Ideal idle fraction of a step for equal-cost stages: (p-1)/(m+p-1)."""
    return (pp_size - 1) / (num_micro_batches + pp_size - 1)
