"""Pipeline schedules as data: every micro-batch (and chunk) forwarded then backwarded once, in
order, with each schedule's in-flight bound; a simulation showing the per-stage lists fit
together (no stage waits for something that is never sent) with the ideal bubble; both ends of
every point-to-point stream list its tensors in the same order; and a stage's run hands the
trainer each micro-batch's training_step and backward once, with the loss known by its backward."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest
import torch

from nanolight.parallel.pipeline import (
    all_forward_all_backward,
    bubble_fraction,
    check_micro_batches,
    interleaved_1f1b,
    max_in_flight,
    one_forward_one_backward,
    stage_schedule,
)
from nanolight.parallel.pipeline.runner import StepRun
from nanolight.parallel.pipeline.schedules import BACKWARD, FORWARD, stage_program

# (name, p, v, m): every schedule at a few layouts; interleaving needs m to be a multiple of p
LAYOUTS = [(name, p, 1, m) for name in ("1f1b", "afab") for p, m in [(2, 2), (2, 8), (4, 4), (4, 9), (3, 7)]]
LAYOUTS += [
    ("interleaved_1f1b", p, v, m) for p, v, m in [(2, 2, 2), (2, 2, 8), (2, 3, 4), (4, 2, 4), (4, 3, 8)]
]


@pytest.mark.parametrize(("name", "p", "v", "m"), LAYOUTS)
def test_each_micro_batch_and_chunk_once_forward_before_backward(name: str, p: int, v: int, m: int) -> None:
    for s in range(p):
        sched = stage_schedule(name, m, p, s, v)
        units = sorted((i, c) for i in range(m) for c in range(v))
        assert sorted((i, c) for k, i, c in sched if k == FORWARD) == units
        assert sorted((i, c) for k, i, c in sched if k == BACKWARD) == units
        for k, i, c in sched:
            if k == BACKWARD:
                assert sched.index((FORWARD, i, c)) < sched.index((BACKWARD, i, c))
        for i in range(m):  # a micro-batch's chunks in model order forwards, reversed backwards
            assert [c for k, j, c in sched if k == FORWARD and j == i] == list(range(v))
            assert [c for k, j, c in sched if k == BACKWARD and j == i] == list(range(v))[::-1]


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


def test_interleaved_phases_and_in_flight_bound() -> None:
    assert interleaved_1f1b(4, 2, 0, 2) == [
        # warm-up: 2*(p-r-1) + (v-1)*p = 4 chunk forwards; chunk 0 of micro-batches 0, 1, then chunk 1
        ("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1),
        # steady: the next chunk forward, then the oldest chunk backward (chunks reversed)
        ("F", 2, 0), ("B", 0, 1), ("F", 3, 0), ("B", 1, 1), ("F", 2, 1), ("B", 0, 0), ("F", 3, 1), ("B", 1, 0),
        # cool-down: the backwards still in flight
        ("B", 2, 1), ("B", 3, 1), ("B", 2, 0), ("B", 3, 0),
    ]  # fmt: skip
    assert interleaved_1f1b(4, 2, 1, 2)[:4] == [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("B", 0, 1)]
    for p, v, m in [(2, 2, 8), (4, 2, 8), (4, 4, 16), (8, 2, 8)]:
        # chunk activations alive at once (each 1/v of the rank's layers): warm-up + 1
        assert [max_in_flight(interleaved_1f1b(m, p, s, v)) for s in range(p)] == [
            min(m * v, 2 * (p - s - 1) + (v - 1) * p + 1) for s in range(p)
        ]


def _simulate(name: str, p: int, v: int, m: int, backward_cost: int = 1) -> int:
    """F of a chunk costs 1, B `backward_cost`; virtual stage g = c*p + r runs on rank r. F(i, g)
    needs F(i, g-1); B(i, g) needs B(i, g+1) (and F(i, g)). Returns the makespan; raises if the
    schedules deadlock."""
    scheds = [stage_schedule(name, m, p, r, v) for r in range(p)]
    last = p * v - 1
    done: dict[tuple[str, int, int], int] = {}  # (kind, i, virtual stage) -> finish time
    pos, clock = [0] * p, [0] * p
    while any(pos[r] < len(scheds[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            if pos[r] == len(scheds[r]):
                continue
            kind, i, c = scheds[r][pos[r]]
            g = c * p + r
            dep = (FORWARD, i, g - 1) if kind == FORWARD and g > 0 else None
            dep = (BACKWARD, i, g + 1) if kind == BACKWARD and g < last else dep
            if dep is not None and dep not in done:
                continue
            start = max(clock[r], done[dep] if dep else 0)
            clock[r] = done[(kind, i, g)] = start + (1 if kind == FORWARD else backward_cost)
            pos[r] += 1
            progressed = True
        assert progressed, f"deadlock: {name} p={p} v={v} m={m} at {pos}"
    return max(clock)


@pytest.mark.parametrize(("name", "p", "v", "m"), [x for x in LAYOUTS if x[3] >= x[1]])
@pytest.mark.parametrize("backward_cost", [1, 2])
def test_schedules_fit_together_with_the_ideal_bubble(
    name: str, p: int, v: int, m: int, backward_cost: int
) -> None:
    makespan = _simulate(name, p, v, m, backward_cost)
    busy = m * v * (1 + backward_cost)  # each rank: m*v chunk forwards and backwards
    assert (makespan - busy) / makespan == pytest.approx(bubble_fraction(m, p, v))


def test_interleaved_never_deadlocks_at_an_allowed_layout() -> None:
    """Every (p, v, m) the checks allow, up to p = 8, v = 4, m = 4p."""
    for p in range(2, 9):
        for v in range(2, 5):
            for m in range(p, 4 * p + 1, p):
                check_micro_batches(p, "interleaved_1f1b", m)
                _simulate("interleaved_1f1b", p, v, m)


def _stream(scheds: list, p: int, v: int, src: int, dst: int, kind: str) -> tuple[list, list]:
    """The (micro-batch, virtual stage boundary) tensors rank src sends rank dst on the forward
    (kind F: activations) or backward (kind B: gradients) stream, in src's send order and in
    dst's receive order."""
    last = p * v - 1
    sent, received = [], []
    for k, i, c in scheds[src]:
        g = c * p + src
        if k == kind == FORWARD and g < last and (g + 1) % p == dst:
            sent.append((i, g + 1))
        if k == kind == BACKWARD and g > 0 and (g - 1) % p == dst:
            sent.append((i, g))
    for k, i, c in scheds[dst]:
        g = c * p + dst
        if k == kind == FORWARD and g > 0 and (g - 1) % p == src:
            received.append((i, g))
        if k == kind == BACKWARD and g < last and (g + 1) % p == src:
            received.append((i, g + 1))
    return sent, received


@pytest.mark.parametrize(("name", "p", "v", "m"), LAYOUTS)
def test_both_ends_of_each_stream_list_its_tensors_in_the_same_order(
    name: str, p: int, v: int, m: int
) -> None:
    """Each stream is a FIFO per direction (`p2p.py`): the k-th tensor sent is the k-th received."""
    scheds = [stage_schedule(name, m, p, r, v) for r in range(p)]
    for src in range(p):
        for dst in {(src + 1) % p, (src - 1) % p} - {src}:
            for kind in (FORWARD, BACKWARD):
                sent, received = _stream(scheds, p, v, src, dst, kind)
                assert sent == received, (src, dst, kind)


class _Chunks:
    """Rank r's v chunks, each ``x * w`` (the last virtual stage sums: the loss)."""

    def __init__(self, p: int, r: int, v: int) -> None:
        self.virtual_stages, self.num_chunks = [c * p + r for c in range(v)], p * v
        self.w = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, c: int, input_ids: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        out = kwargs.get("hidden_states", input_ids) * self.w
        return out.sum() if self.virtual_stages[c] == self.num_chunks - 1 else out


class _Neighbours:
    """The other ranks, as far as one rank sees them: every receive is already there."""

    posted = 0

    def exchange(self, sends: list, recvs: list) -> None:
        for recv in recvs:
            recv.tensor = torch.ones(2, 3)

    def wait(self, recv: Any) -> torch.Tensor:
        return recv.tensor

    def complete_first(self, count: int) -> None:
        pass


@pytest.mark.parametrize(("name", "p", "v", "m"), LAYOUTS)
def test_the_run_hands_the_trainer_each_micro_batch_once_and_the_loss_before_its_backward(
    name: str, p: int, v: int, m: int
) -> None:
    """`StepRun.steps()` on each rank's program: every micro-batch's training_step and backward
    are yielded once each, forward first; its model call runs its first chunk; on the last rank the
    loss the trainer back-propagates holds the real value by then (the placeholder filled under
    interleaving), and with one chunk per rank the call itself returns the real loss."""
    for r in range(p):
        chunks = _Chunks(p, r, v)
        program = stage_program(name, m, p, r, v)
        run = StepRun(program, m, chunks, _Neighbours(), lambda last: None, nullcontext, check=True)
        handed, losses = [], {}
        for kind, i in run.steps():
            handed.append((kind, i))
            if kind == FORWARD:
                losses[i] = run.call(torch.ones(2, 3), (), {})
                continue
            if r == p - 1:
                # the last chunk's input is a received activation (ones): sum(ones(2, 3) * 2)
                assert losses[i].item() == 12.0, f"micro-batch {i}: the loss is read before it is known"
            run.backward(losses[i] / m)
        assert sorted(handed) == sorted((k, i) for k in (FORWARD, BACKWARD) for i in range(m))
        assert all(handed.index((FORWARD, i)) < handed.index((BACKWARD, i)) for i in range(m))
        if v == 1:
            assert handed == [(k, i) for k, i, _ in stage_schedule(name, m, p, r, v)]
        if v == 1 and r == p - 1:  # the model call itself returned the real loss
            assert all(type(loss.grad_fn).__name__ != "PlaceholderBackward" for loss in losses.values())


def test_micro_batch_checks_say_how_to_fix() -> None:
    with pytest.raises(ValueError, match=r"at least pp=4 micro-batches.*accumulate_grad_batches"):
        check_micro_batches(4, "1f1b", 2)
    check_micro_batches(4, "afab", 2)  # all-forward-all-backward has no such requirement
    with pytest.raises(ValueError, match=r"multiple of pp=2 .*accumulate_grad_batches=4 or 6"):
        check_micro_batches(2, "interleaved_1f1b", 5)
    with pytest.raises(ValueError, match=r"multiple of pp=4 .*accumulate_grad_batches=4$"):
        check_micro_batches(4, "interleaved_1f1b", 3)
    check_micro_batches(2, "interleaved_1f1b", 6)
