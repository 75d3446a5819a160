"""Pipeline schedules as data: every micro-batch forwarded then backwarded once, in order, with
1F1B's in-flight bound, and a simulation showing the per-stage lists fit together (no stage
waits for something that is never sent)."""

from __future__ import annotations

import pytest

from nanolight.parallel.pipeline import (
    all_forward_all_backward,
    bubble_fraction,
    build_schedule,
    max_in_flight,
    one_forward_one_backward,
)
from nanolight.parallel.pipeline.schedules import BACKWARD, FORWARD


@pytest.mark.parametrize("name", ["1f1b", "afab"])
@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 8), (4, 4), (4, 9), (4, 2), (8, 16)])
def test_each_micro_batch_once_forward_before_backward(name: str, p: int, m: int) -> None:
    for s in range(p):
        sched = build_schedule(name, m, p, s)
        assert [i for k, i in sched if k == FORWARD] == list(range(m))
        assert [i for k, i in sched if k == BACKWARD] == list(range(m))
        for k, i in sched:
            if k == BACKWARD:
                assert sched.index((FORWARD, i)) < sched.index((BACKWARD, i))


def test_1f1b_phases_and_in_flight_bound() -> None:
    assert one_forward_one_backward(4, 2, 0) == [
        ("F", 0),  # warm-up: p - s - 1 = 1 forward
        ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2),  # steady: 1F1B
        ("B", 3),  # cool-down
    ]  # fmt: skip
    for p, m in [(2, 8), (4, 8), (8, 32)]:
        assert [max_in_flight(one_forward_one_backward(m, p, s)) for s in range(p)] == [
            p - s for s in range(p)
        ]
        assert max_in_flight(all_forward_all_backward(m)) == m


def _simulate(p: int, m: int, name: str) -> int:
    """Unit-time F and B; a stage's F(i) needs F(i) of the previous stage, its B(i) the next
    stage's B(i). Returns the makespan; raises if the schedules deadlock."""
    scheds = [build_schedule(name, m, p, s) for s in range(p)]
    done: dict[tuple[int, str, int], int] = {}  # (stage, kind, i) -> finish time
    pos, clock = [0] * p, [0] * p
    while any(pos[s] < len(scheds[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if pos[s] == len(scheds[s]):
                continue
            kind, i = scheds[s][pos[s]]
            dep = (s - 1, FORWARD, i) if kind == FORWARD and s > 0 else None
            dep = (s + 1, BACKWARD, i) if kind == BACKWARD and s < p - 1 else dep
            if dep is not None and dep not in done:
                continue
            start = max(clock[s], done[dep] if dep else 0)
            clock[s] = done[(s, kind, i)] = start + 1
            pos[s] += 1
            progressed = True
        assert progressed, "deadlock"
    return max(clock)


@pytest.mark.parametrize("name", ["1f1b", "afab"])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 4), (3, 7)])
def test_schedules_fit_together_with_the_ideal_bubble(name: str, p: int, m: int) -> None:
    makespan = _simulate(p, m, name)
    busy = 2 * m  # each stage does m forwards and m backwards
    assert (makespan - busy) / makespan == pytest.approx(bubble_fraction(m, p))
