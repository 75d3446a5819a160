"""``precision="bf16-master"`` under `Parallel3DStrategy` against ``bf16-mixed``, layout by layout.

Each worker trains the same tiny Llama under both precisions and records what crosses the wire,
by wrapping ``torch.distributed``'s pipeline sends and reading `ZeroOptimizer.gathered_bytes`:
under bf16-master the activations and gradients sent between stages and the weights ZeRO-1
all-gathers are bf16, half of bf16-mixed's bytes; the activations between blocks are bf16; and
the step losses agree within bf16 tolerance (kernels differ by instruction set: no recorded values).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _tiny import StepLosses, TinyLM, run_distributed, tiny_config, token_loader

from nanolight import Callback, NanoTrainer
from nanolight.parallel.blocks import decoder_blocks
from nanolight.parallel.zero import masters_in_model
from nanolight.strategies.parallel3d import Parallel3DStrategy

SEED, STEPS, ACCUM, MICRO = 7, 3, 4, 2
BUCKET = 16 * 1024  # bytes: many buckets; an untied head (32 KB in fp32) is a bucket of its own


class Wire:
    """Floating-point tensors this rank sends to pipeline neighbours (batched or plain sends)."""

    def __init__(self) -> None:
        self.bytes, self.dtypes = 0, set()
        self._batched, self._send = dist.batch_isend_irecv, dist.send

    def _count(self, tensor: torch.Tensor) -> None:
        if tensor.is_floating_point():
            self.bytes += tensor.numel() * tensor.element_size()
            self.dtypes.add(tensor.dtype)

    def __enter__(self) -> Wire:
        def batched(ops: list[Any]) -> Any:
            for op in ops:
                if getattr(op.op, "__name__", "") == "isend":
                    self._count(op.tensor)
            return self._batched(ops)

        def send(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self._count(tensor)
            return self._send(tensor, *args, **kwargs)

        dist.batch_isend_irecv, dist.send = (
            functools.wraps(self._batched)(batched),
            functools.wraps(self._send)(send),
        )
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.batch_isend_irecv, dist.send = self._batched, self._send


class BlockDtypes(Callback):
    """The dtype of each of this rank's decoder blocks' outputs (the residual stream)."""

    def __init__(self) -> None:
        self.dtypes: set[str] = set()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        for _, block in decoder_blocks(pl_module)[1]:
            block.register_forward_hook(lambda _m, _a, out: self.dtypes.add(str(out.dtype)))


class InFlight(Callback):
    """ZeRO-1's weight all-gathers in flight right after each update, and once the next forward ran."""

    def __init__(self) -> None:
        self.after_step: list[int] = []
        self.after_forward: list[int] = []

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        zero = trainer.strategy.grads.zero
        if zero is not None and (batch_idx + 1) % ACCUM == 0:
            self.after_step.append(zero.gathers_in_flight)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        zero = trainer.strategy.grads.zero
        if zero is not None and len(self.after_forward) < len(self.after_step):
            self.after_forward.append(zero.gathers_in_flight)


def _worker(rank: int, world: int, root: str, layout: dict[str, Any], tied: bool) -> dict[str, Any]:
    out = {}
    for precision in ("bf16-mixed", "bf16-master"):
        losses, blocks, in_flight = StepLosses(), BlockDtypes(), InFlight()
        trainer = NanoTrainer(
            max_steps=STEPS, accumulate_grad_batches=ACCUM, gradient_clip_val=1.0, seed=SEED,
            strategy=Parallel3DStrategy(precision=precision, dp_bucket_bytes=BUCKET, **layout), callbacks=[losses, blocks, in_flight],
            default_root_dir=Path(root) / precision, logger=False, enable_progress_bar=False,
            enable_checkpointing=False,
        )  # fmt: skip
        module = TinyLM(tiny_config(layers=4, tied=tied), seed=SEED)
        with Wire() as wire:
            trainer.fit(module, token_loader(STEPS * ACCUM * MICRO * world, batch_size=MICRO))
        zero = trainer.strategy.grads.zero
        out[precision] = {
            "losses": losses.losses,
            "norms": losses.norms,
            "p2p_bytes": wire.bytes,
            "p2p_dtypes": sorted(str(d) for d in wire.dtypes),
            "gathered_bytes": zero.gathered_bytes if zero is not None else 0,
            "blocks": sorted(blocks.dtypes),
            "weights": sorted({str(p.dtype) for p in module.parameters()}),
            "in_flight": (in_flight.after_step, in_flight.after_forward),
            "buckets": len(zero.reducer.buckets) if zero is not None else 0,
        }
    return out


LAYOUTS = [
    pytest.param({"dp": 2, "zero_stage": 1}, 2, False, id="dp2-zero1-untied"),
    pytest.param({"tp": 2}, 2, True, id="tp2", marks=pytest.mark.slow),
    pytest.param({"pp": 2}, 2, True, id="pp2-1f1b", marks=pytest.mark.slow),
    pytest.param(
        {"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual": 2},
        2,
        True,
        id="pp2-interleaved",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        {"tp": 2, "pp": 2, "dp": 2, "zero_stage": 1}, 8, True, id="tp2-pp2-dp2", marks=pytest.mark.slow
    ),
]


@pytest.mark.parametrize(("layout", "world", "tied"), LAYOUTS)
def test_bf16_master_halves_the_wire_and_tracks_bf16_mixed(
    tmp_path: Path, layout: dict[str, Any], world: int, tied: bool
) -> None:
    ranks = run_distributed(_worker, world, str(tmp_path), layout, tied, timeout=600, pg_timeout=120)
    pipelined, sharded = layout.get("pp", 1) > 1, layout.get("dp", 1) > 1
    for rank, run in enumerate(ranks):
        mixed, master = run["bf16-mixed"], run["bf16-master"]
        assert master["weights"] == ["torch.bfloat16"] and mixed["weights"] == ["torch.float32"]
        assert master["blocks"] == ["torch.bfloat16"] and mixed["blocks"] == ["torch.float32"], rank
        if pipelined:  # activations forward, their gradients back: bf16, half the bytes
            assert master["p2p_dtypes"] == ["torch.bfloat16"] and mixed["p2p_dtypes"] == ["torch.float32"]
            assert mixed["p2p_bytes"] > 0 and master["p2p_bytes"] * 2 == mixed["p2p_bytes"], rank
        if sharded:  # ZeRO-1's all-gather of the updated weights: bf16, half the bytes
            assert mixed["gathered_bytes"] > 0 and master["gathered_bytes"] * 2 == mixed["gathered_bytes"], (
                rank
            )
            # bf16-master leaves every bucket's gather in flight after the step; the next forward waits
            after_step, after_forward = master["in_flight"]
            assert after_step == [master["buckets"]] * STEPS and master["buckets"] > 1, rank
            assert after_forward == [0] * (STEPS - 1), rank  # the last step has no next forward
            assert mixed["in_flight"][0] == [0] * STEPS  # bf16-mixed gathers synchronously
        assert len(master["losses"]) == STEPS
        torch.testing.assert_close(
            torch.tensor(master["losses"]), torch.tensor(mixed["losses"]), rtol=0, atol=0.03
        )
        torch.testing.assert_close(
            torch.tensor(master["norms"]), torch.tensor(mixed["norms"]), rtol=0.05, atol=0
        )
    print(
        f"{layout}: p2p bytes/step mixed {ranks[0]['bf16-mixed']['p2p_bytes'] // STEPS} "
        f"master {ranks[0]['bf16-master']['p2p_bytes'] // STEPS}; all-gathered bytes/step mixed "
        f"{ranks[0]['bf16-mixed']['gathered_bytes'] // STEPS} master {ranks[0]['bf16-master']['gathered_bytes'] // STEPS}"
    )


class HeadReadDirectly(torch.nn.Module):
    """Blocks, then a head whose weight the parent reads itself (as a fused loss does): the head's
    own forward never runs, so only the wait after the last block can cover its bucket."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
        self.head = torch.nn.Linear(16, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return (x @ self.head.weight.t()).float().pow(2).mean()


def _overlap_worker(rank: int, world: int, overlap: bool) -> list[Any]:
    from nanolight.parallel.zero import ZeroOptimizer

    torch.manual_seed(0)
    model = HeadReadDirectly()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # tiny buckets: the head (2 KB in fp32) has one of its own
    zero = ZeroOptimizer(opt, dist.group.WORLD, bucket_bytes=1024, grad_dtype=torch.float32)
    model.to(torch.bfloat16)
    if overlap:
        zero.overlap_weight_gather(model.modules(), model.blocks[-1])
    seen = []
    for step in range(3):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank)).bfloat16()
        loss = model(x)
        seen.append((zero.gathers_in_flight, loss.item()))
        loss.backward()
        zero.step()
        seen.append(zero.gathers_in_flight)
    return [seen, len(zero.reducer.buckets)]


def test_overlapped_weight_gather_equals_the_blocking_one() -> None:
    """The post-step bf16 all-gather left in flight and waited for in the next forward (a weight read
    outside its module included) gives bitwise the losses of gathering at the step."""
    overlapped = run_distributed(_overlap_worker, 2, True, timeout=120)
    blocking = run_distributed(_overlap_worker, 2, False, timeout=120)
    for (seen, buckets), (ref, _) in zip(overlapped, blocking, strict=True):
        assert buckets > 2
        assert seen[1::2] == [buckets] * 3 and ref[1::2] == [0] * 3  # in flight after each step
        assert [s[0] for s in seen[0::2]] == [0, 0, 0]  # none left once the forward ran
        assert [s[1] for s in seen[0::2]] == [s[1] for s in ref[0::2]]


def _resume_worker(rank: int, world: int, root: str, steps: int, ckpt: str | None) -> Any:
    from nanolight.callbacks import ModelCheckpoint

    seen = StepLosses()
    save = ModelCheckpoint(
        dirpath=Path(root) / "ckpt", filename="step-{step}", auto_insert_metric_name=False,
        every_n_train_steps=2, save_top_k=-1,
    )  # fmt: skip
    trainer = NanoTrainer(
        max_steps=steps, accumulate_grad_batches=2, gradient_clip_val=1.0, seed=SEED, callbacks=[seen, save],
        strategy=Parallel3DStrategy(dp=2, zero_stage=1, precision="bf16-master", dp_bucket_bytes=BUCKET),
        default_root_dir=root, logger=False, enable_progress_bar=False,
    )  # fmt: skip
    module = TinyLM(tiny_config(tied=False), seed=SEED, warmup=2)
    trainer.fit(module, token_loader(4 * 2 * MICRO * world, batch_size=MICRO), ckpt_path=ckpt)
    with masters_in_model(trainer.optimizers):  # collective: every dp rank takes part
        masters = {n: p.detach().numpy().copy() for n, p in module.named_parameters()}  # by value
    return seen.losses, masters


@pytest.mark.slow
def test_dp2_zero1_checkpoint_holds_masters_and_resumes_exactly(tmp_path: Path) -> None:
    """dp2 ZeRO-1 under bf16-master: each rank's 1/dp of the fp32 masters is gathered into the
    checkpoint; a resume at step 2 ends bitwise where the whole run does; one 32-true process reads
    the masters as its weights."""
    from _tiny import full_state

    whole = run_distributed(_resume_worker, 2, str(tmp_path / "whole"), 4, None, timeout=300)
    ckpt = tmp_path / "whole" / "ckpt" / "step-2"
    resumed = run_distributed(_resume_worker, 2, str(tmp_path / "resumed"), 4, str(ckpt), timeout=300)
    (losses, masters), (resumed_losses, resumed_masters) = whole[0], resumed[0]
    masters = {n: torch.from_numpy(a) for n, a in masters.items()}
    resumed_masters = {n: torch.from_numpy(a) for n, a in resumed_masters.items()}
    assert resumed_losses == losses[2:]
    assert all(torch.equal(resumed_masters[n], masters[n]) for n in masters)
    state, _ = full_state(
        tmp_path / "whole" / "ckpt" / "step-4", TinyLM(tiny_config(tied=False), warmup=2), 4
    )
    assert all(torch.equal(state[n], masters[n]) for n in masters)
    assert {t.dtype for t in state.values()} == {torch.float32}


def _recorded_steps_worker(rank: int, world: int, root: str) -> Any:
    from _nccl_emulation import recording

    trainer = NanoTrainer(
        max_steps=3, seed=SEED, logger=False, enable_progress_bar=False, enable_checkpointing=False,
        strategy=Parallel3DStrategy(dp=2, zero_stage=1, precision="bf16-master", dp_bucket_bytes=BUCKET),
        default_root_dir=root,
    )  # fmt: skip
    trainer.fit(TinyLM(tiny_config(layers=2), seed=SEED), token_loader(3 * MICRO * world, targets=True))
    return recording()


def test_the_step_count_does_not_queue_behind_the_weight_gathers(tmp_path: Path) -> None:
    """Each step's valid-target count (a blocking all-reduce: micro-batch 0's loss divides by it)
    is issued before the next forward waits for ZeRO-1's overlapped bf16 gathers. NCCL runs one
    communicator's ops in issue order, so on the gathers' communicator the count -- and the compute
    stream waiting for it -- would stall until every bucket's gather finished, before the first
    layer (recorded under `_nccl_emulation`: which op on which group, and when each is waited for)."""
    for ops in run_distributed(_recorded_steps_worker, 2, str(tmp_path), timeout=300):
        waited = {op.target: op.seq for op in ops if op.kind == "wait"}
        gathers = [op for op in ops if op.kind == "collective" and op.name.startswith("all_gather")]
        counts = [op for op in ops if op.name == "all_reduce" and op.dtype == "torch.int64"]
        assert len(counts) == 3 and len(gathers) >= 2 * 2  # three steps, two or more buckets each
        behind = [
            (c.seq, g.seq)
            for c in counts
            for g in gathers
            if g.group == c.group and g.seq < c.seq < waited.get(g.seq, len(ops))
        ]
        assert not behind, f"(count, gather in flight on its communicator): {behind}"
