"""The pipeline's point-to-point traffic keeps NCCL's rules and its schedule's memory bound (gloo, CPU).

gloo forgives what NCCL hangs on, so `_nccl_emulation` records every op each rank issues and checks
the recordings by NCCL's rules (see its docstring; its order rules: `test_nccl_emulation.py`).
First the checker itself is shown to catch each break, on hand-written recordings and on real torch calls; then every schedule's training
run must come out clean. The same runs check what the stage reports about its traffic (bytes
sent per stream and step) and what it held for sends at once: exactly what its program says
(`schedules.held_sends`), whatever the peers' timing.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _nccl_emulation import Msg, Op, assert_nccl_safe, install, nccl_problems, recording
from _tiny import run_distributed
from test_pp_engine import SEED, B, T, Wrapper, _loader, pp_config

from nanolight import NanoTrainer
from nanolight.parallel.pipeline.schedules import held_sends, stage_program
from nanolight.strategies.parallel3d import Parallel3DStrategy

M = 8  # micro-batches per step: 1F1B's bound (p - s) is well under it
ACT = B * T * 64 * 4  # bytes of one activation (B, T, hidden 64) in fp32


# ---- the checker, on recordings written by hand ------------------------------------------------
def _op(rank: int, seq: int, kind: str, peer: int | None, batched: bool = True, **kw) -> Op:  # noqa: ANN003
    """One tensor sent or received, in a batch of its own or as a plain send / recv."""
    msg = Msg(kind == "send", peer, kw.pop("shape", (2, 3)), kw.pop("dtype", "torch.float32"))
    return Op(rank, seq, "batch" if batched else kind, kw.pop("group", "g"), kw.pop("ranks", (0, 1)), (msg,))


def problems(recordings: list[list[Op]]) -> list[str]:
    return nccl_problems(recordings)


def test_checker_accepts_paired_batched_traffic() -> None:
    rank0 = [_op(0, 0, "send", 1), _op(0, 1, "send", 1, shape=(4,)), _op(0, 2, "recv", 1)]
    rank1 = [_op(1, 0, "recv", 0), _op(1, 1, "recv", 0, shape=(4,)), _op(1, 2, "send", 0)]
    assert problems([rank0, rank1]) == []


@pytest.mark.parametrize(
    ("rank1", "found"),
    [
        ([_op(1, 0, "recv", 0, batched=False)], "sent in a batch_isend_irecv but received as a plain recv"),
        ([_op(1, 0, "recv", 0, shape=(3, 2))], "sent (2, 3) torch.float32, received into (3, 2)"),
        ([_op(1, 0, "recv", 0, dtype="torch.bfloat16")], "received into (2, 3) torch.bfloat16"),
        ([], "is never received"),
        ([_op(1, 0, "recv", 0), _op(1, 1, "recv", 0)], "is never sent"),
        ([_op(1, 0, "recv", None, batched=False)], "from any source"),
    ],
    ids=["batched-vs-plain", "shape", "dtype", "unreceived", "unsent", "any-source"],
)
def test_checker_finds_a_mismatched_pair(rank1: list[Op], found: str) -> None:
    assert any(found in p for p in problems([[_op(0, 0, "send", 1)], rank1])), problems(
        [[_op(0, 0, "send", 1)], rank1]
    )


def test_checker_finds_a_first_batched_call_not_joined_by_every_rank() -> None:
    """Three ranks in a line: 0 -> 1 then 1 -> 2. Rank 2's first call meets rank 1's second."""
    ranks = (0, 1, 2)
    rec = [
        [_op(0, 0, "send", 1, ranks=ranks)],
        [_op(1, 0, "recv", 0, ranks=ranks), _op(1, 1, "send", 2, ranks=ranks)],
        [_op(2, 0, "recv", 1, ranks=ranks)],
    ]
    assert any("meets rank 1's op 1, not its first" in p for p in problems(rec)), problems(rec)
    assert any("not joined by rank(s) [2]" in p for p in problems(rec[:2] + [[]]))
    warm = [[Op(r, -1, "collective", "g", ranks, name="all_reduce"), *ops] for r, ops in enumerate(rec)]
    assert problems(warm) == []  # a collective first on every rank: any batched call may follow


# ---- the recorder, on real torch calls -----------------------------------------------------
def _raw_worker(rank: int, world: int, safe: bool) -> list[Op]:
    install()
    group = dist.new_group([0, 1])
    if safe:
        dist.all_reduce(torch.zeros(1), group=group)
    meta, x = torch.arange(8), torch.ones(2, 3)
    if rank == 0:
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, 1, group) for t in (meta, x)]):
            w.wait()
    else:
        got = torch.empty(8, dtype=torch.int64)
        if safe:
            dist.batch_isend_irecv([dist.P2POp(dist.irecv, got, 0, group)])[0].wait()
        else:  # the pipeline's metadata receive before this change
            dist.recv(got, src=0, group=group)
        dist.batch_isend_irecv([dist.P2POp(dist.irecv, torch.empty(2, 3), 0, group)])[0].wait()
    return recording()


def test_recorder_catches_a_plain_recv_of_a_batched_send() -> None:
    unsafe = problems(run_distributed(_raw_worker, 2, False, check_nccl=False))
    assert any("received as a plain recv" in p for p in unsafe), unsafe
    assert any("first batched call" in p for p in unsafe), unsafe
    assert_nccl_safe(run_distributed(_raw_worker, 2, True))


# ---- the pipeline's traffic ----------------------------------------------------------------
def _pipeline_worker(rank: int, world: int, tp: int, pp: int, dp: int, schedule: str, virtual: int) -> dict:
    install()
    cfg = pp_config(tied=True, layers=max(4, pp * virtual))
    strategy = Parallel3DStrategy(
        tp=tp, pp=pp, dp=dp, pp_schedule=schedule, pp_virtual=virtual, init_seed=SEED
    )
    trainer = NanoTrainer(
        use_distributed_sampler=False, max_steps=2, accumulate_grad_batches=M, strategy=strategy, logger=False,
        enable_progress_bar=False, enable_checkpointing=False,
    )  # fmt: skip
    module = Wrapper(cfg)
    trainer.fit(module, train_dataloaders=_loader(cfg, steps=2, micro=M))
    p2p, ctx = strategy.stage.p2p, strategy.parallel.context
    step = p2p.last_traffic
    with torch.no_grad():  # a forward-only pass (as in validation) of a new shape: new metadata
        module.model(torch.zeros(1, T // 2, dtype=torch.long))
    return {
        "ops": recording(),
        "pp_rank": ctx.pp_rank,
        "sent": step.sent_bytes,  # the second step's
        "held_peak": step.peak_held_bytes,
    }


def _check_traffic(tp: int, pp: int, dp: int, schedule: str, virtual: int = 1) -> None:
    out = run_distributed(
        _pipeline_worker, tp * pp * dp, tp, pp, dp, schedule, virtual, timeout=300, pg_timeout=60
    )
    assert_nccl_safe([r["ops"] for r in out])
    for r in out:
        s = r["pp_rank"]
        stages = [c * pp + s for c in range(virtual)]  # this rank's virtual stages
        forward_sends = sum(g < pp * virtual - 1 for g in stages) * M  # activations to the next stage
        backward_sends = sum(g > 0 for g in stages) * M  # gradients to the previous one
        assert r["sent"] == [forward_sends * ACT, backward_sends * ACT], r
        # what the stage held for sends at once follows its program, whatever the peers' timing:
        # at most two activations and two gradients (holding every send until the step ends, as
        # once, reaches M = 8 here); the memory probe sees the same tensors freed
        # (tests/test_planner_memory.py)
        held = held_sends(stage_program(schedule, M, pp, s, virtual), pp, s, virtual)
        assert r["held_peak"] == [held[0] * ACT, held[1] * ACT], (r["held_peak"], held)
        assert max(held[:2]) <= 2 < M


def test_pp2_1f1b_traffic_is_nccl_safe_and_held_as_planned() -> None:
    _check_traffic(tp=1, pp=2, dp=1, schedule="1f1b")


def test_pp2_interleaved_traffic_is_nccl_safe_and_held_as_planned() -> None:
    _check_traffic(tp=1, pp=2, dp=1, schedule="interleaved_1f1b", virtual=2)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("tp", "pp", "dp", "schedule", "virtual"),
    [
        (1, 2, 1, "afab", 1),
        (1, 4, 1, "1f1b", 1),
        (1, 4, 1, "afab", 1),
        (1, 4, 1, "interleaved_1f1b", 2),
        (2, 2, 1, "1f1b", 1),
        (1, 2, 2, "interleaved_1f1b", 2),
        (2, 2, 2, "afab", 1),
    ],
    ids=["pp2-afab", "pp4-1f1b", "pp4-afab", "pp4v2", "tp2xpp2-1f1b", "pp2v2xdp2", "tp2xpp2xdp2-afab"],
)
def test_traffic_matrix(tp: int, pp: int, dp: int, schedule: str, virtual: int) -> None:
    _check_traffic(tp, pp, dp, schedule, virtual)
