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
from nanolight.strategies.parallel3d import Parallel3DStrategy

SEED, STEPS, ACCUM, MICRO = 7, 3, 4, 2


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


def _worker(rank: int, world: int, root: str, layout: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for precision in ("bf16-mixed", "bf16-master"):
        losses, blocks = StepLosses(), BlockDtypes()
        trainer = NanoTrainer(
            max_steps=STEPS, accumulate_grad_batches=ACCUM, gradient_clip_val=1.0, seed=SEED,
            strategy=Parallel3DStrategy(precision=precision, **layout), callbacks=[losses, blocks],
            default_root_dir=Path(root) / precision, logger=False, enable_progress_bar=False,
            enable_checkpointing=False,
        )  # fmt: skip
        module = TinyLM(tiny_config(layers=4), seed=SEED)
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
        }
    return out


LAYOUTS = [
    pytest.param({"dp": 2, "zero_stage": 1}, 2, id="dp2-zero1"),
    pytest.param({"tp": 2}, 2, id="tp2", marks=pytest.mark.slow),
    pytest.param({"pp": 2}, 2, id="pp2-1f1b", marks=pytest.mark.slow),
    pytest.param(
        {"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual": 2},
        2,
        id="pp2-interleaved",
        marks=pytest.mark.slow,
    ),
    pytest.param({"tp": 2, "pp": 2, "dp": 2, "zero_stage": 1}, 8, id="tp2-pp2-dp2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("layout", "world"), LAYOUTS)
def test_bf16_master_halves_the_wire_and_tracks_bf16_mixed(
    tmp_path: Path, layout: dict[str, Any], world: int
) -> None:
    ranks = run_distributed(_worker, world, str(tmp_path), layout, timeout=600, pg_timeout=120)
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
