"""Checkpoints written before the core redesign (nanolight 0.1.0, tests/fixtures/legacy_v1/, made by
fixtures/make_legacy_checkpoints.py) still load: a one-process step directory and a tp2·pp2·dp2
ZeRO-1 one resume on one device, and at tp2, with the losses the uninterrupted run had."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from _dist import run_distributed

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from make_legacy_checkpoints import OUT, LegacyLM, Losses, loader, trainer  # noqa: E402

from nanolight.strategies import Parallel3DStrategy, SingleDeviceStrategy  # noqa: E402

EXPECTED = {int(k): v for k, v in json.loads((OUT / "losses.json").read_text()).items()}


@pytest.mark.parametrize("saved", ["single", "tp2_pp2_dp2_zero1"])
def test_legacy_checkpoint_resumes_on_one_device(saved: str) -> None:
    record = Losses()
    t = trainer(SingleDeviceStrategy("cpu"), 4, [record])
    t.fit(LegacyLM(), train_dataloaders=loader(), ckpt_path=str(OUT / saved / "step-2"))
    assert sorted(record.losses) == [3, 4]
    for step, loss in record.losses.items():
        assert loss == pytest.approx(EXPECTED[step], rel=1e-5), (step, loss, EXPECTED[step])


def _tp2(rank: int, world: int, saved: str) -> dict[int, float]:
    record = Losses()
    t = trainer(Parallel3DStrategy(tp=2), 4, [record])
    t.fit(LegacyLM(), train_dataloaders=loader(), ckpt_path=str(OUT / saved / "step-2"))
    return record.losses


@pytest.mark.parametrize("saved", ["single", "tp2_pp2_dp2_zero1"])
def test_legacy_checkpoint_resumes_at_tp2(saved: str) -> None:
    for losses in run_distributed(_tp2, 2, saved, timeout=120):
        assert sorted(losses) == [3, 4]
        for step, loss in losses.items():
            assert loss == pytest.approx(EXPECTED[step], rel=1e-5), (step, loss, EXPECTED[step])


def test_legacy_weights_agree() -> None:
    """Both fixtures hold the same step-2 weights (one run, two layouts), read on one device."""
    from safetensors.torch import load_file

    from nanolight.checkpoint import CheckpointReader

    single = load_file(str(OUT / "single" / "step-2" / "model.safetensors"))
    sharded = CheckpointReader.open(OUT / "tp2_pp2_dp2_zero1" / "step-2").model_state()
    assert single.keys() == sharded.keys()
    for key, value in single.items():
        # AdamW turns last-bit gradient differences (another summation order) into ~1e-5 steps of
        # a few elements at lr 1e-2, so the bound is on the tensor's norm
        rel = torch.linalg.vector_norm(sharded[key] - value) / torch.linalg.vector_norm(value)
        assert rel <= 2e-5, (key, float(rel))
