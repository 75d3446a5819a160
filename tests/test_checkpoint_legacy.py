"""Checkpoints written before the core redesign (nanolight 0.1.0, tests/fixtures/legacy_v1/, made by
fixtures/make_legacy_checkpoints.py) still load: a one-process step directory and a tp2·pp2·dp2
ZeRO-1 one resume on one device, and at tp2, with the losses the uninterrupted run had. So does a
one-process directory of the layout before the one format (the same files plus checksums.json),
whose checksums are still checked."""

from __future__ import annotations

import json
import shutil
import sys
import zlib
from pathlib import Path

import pytest
import torch
from _dist import run_distributed

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from make_legacy_checkpoints import OUT, LegacyLM, Losses, loader, trainer  # noqa: E402

from nanolight.checkpoint import CheckpointError  # noqa: E402
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


def _with_checksums(tmp_path: Path) -> Path:
    """The one-process fixture as the writer before the one format left it: plus checksums.json."""
    step = tmp_path / "step-2"
    shutil.copytree(OUT / "single" / "step-2", step)
    files = [step / name for name in ("model.safetensors", "optimizer.pt", "trainer_state.pt")]
    manifest = {
        f.name: {"size": f.stat().st_size, "crc32": f"{zlib.crc32(f.read_bytes()):08x}"} for f in files
    }
    (step / "checksums.json").write_text(json.dumps(manifest))
    return step


def test_checksummed_one_process_checkpoint_resumes_and_is_verified(tmp_path: Path) -> None:
    step = _with_checksums(tmp_path)
    record = Losses()
    trainer(SingleDeviceStrategy("cpu"), 4, [record]).fit(
        LegacyLM(), train_dataloaders=loader(), ckpt_path=str(step)
    )
    assert sorted(record.losses) == [3, 4]
    for at, loss in record.losses.items():
        assert loss == pytest.approx(EXPECTED[at], rel=1e-5), (at, loss, EXPECTED[at])

    data = (step / "optimizer.pt").read_bytes()  # one flipped bit, the size kept
    (step / "optimizer.pt").write_bytes(data[:-10] + bytes([data[-10] ^ 1]) + data[-9:])
    with pytest.raises(CheckpointError, match=r"optimizer.pt is damaged: its checksum differs"):
        trainer(SingleDeviceStrategy("cpu"), 4).fit(
            LegacyLM(), train_dataloaders=loader(), ckpt_path=str(step)
        )
    (step / "checksums.json").write_bytes(b"\xc7\xff not json")
    with pytest.raises(
        CheckpointError, match=r"checksums file .*checksums.json is unreadable: truncated or damaged"
    ):
        trainer(SingleDeviceStrategy("cpu"), 4).fit(
            LegacyLM(), train_dataloaders=loader(), ckpt_path=str(step)
        )
