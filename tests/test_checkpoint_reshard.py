"""Sharded checkpoints load at any other topology: the weights and the optimizer state (AdamW
moments, ZeRO-1 partitions included) that the new layout holds after loading, saved again from
there, equal the original checkpoint exactly, both read as one process holds them; the files are
per-rank shards (no rank writes the whole model); a single device reads them too. Parallel runs
are checked against single-process runs in test_dp_trainer.py and test_pp_engine.py."""

from __future__ import annotations

import json
from pathlib import Path

import _tiny as tiny
import pytest
import torch
from _tiny import full_state, run_distributed, tiny_config
from torch.utils.data import DataLoader

from nanolight import NanoTrainer
from nanolight.checkpoint import CheckpointReader
from nanolight.models import LlamaConfig
from nanolight.strategies.base import SingleDeviceStrategy
from nanolight.strategies.parallel3d import Parallel3DStrategy

STEPS, T = 3, 16


def _config() -> LlamaConfig:
    return tiny_config(layers=4, heads=8, kv_heads=4)


class TinyLM(tiny.TinyLM):
    def __init__(self) -> None:
        super().__init__(_config(), seed=5, lr=1e-2, decay_groups=True, warmup=2)


def _loader() -> DataLoader:
    x = torch.randint(0, 128, (STEPS * 4, T), generator=torch.Generator().manual_seed(1))
    return DataLoader([{"input_ids": r, "labels": r} for r in x], batch_size=2)


def _trainer(strategy: object, steps: int) -> NanoTrainer:
    return NanoTrainer(
        use_distributed_sampler=False,  # each rank is given its own data
        max_steps=steps, accumulate_grad_batches=2, strategy=strategy, seed=0, logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )  # fmt: skip


def _strategy(world: int, tp: int, pp: int, zero: int, virtual: int) -> Parallel3DStrategy:
    """2 micro-batches a step: interleaved with v > 1, AFAB at pp=4 (1F1B would need 4)."""
    schedule = "interleaved_1f1b" if virtual > 1 else "afab" if pp > 2 else "1f1b"
    dp = world // (tp * pp)
    return Parallel3DStrategy(tp=tp, pp=pp, dp=dp, zero_stage=zero, pp_schedule=schedule, pp_virtual=virtual)


def _save_worker(rank: int, world: int, tp: int, pp: int, zero: int, virtual: int, root: str) -> None:
    strategy = _strategy(world, tp, pp, zero, virtual)
    trainer = _trainer(strategy, STEPS)
    trainer.fit(TinyLM(), train_dataloaders=_loader())  # dp ranks see the same batches: fine here
    trainer.save_checkpoint(Path(root) / "ckpt", update_last=False)


def _load_worker(rank: int, world: int, tp: int, pp: int, zero: int, virtual: int, root: str) -> None:
    strategy = _strategy(world, tp, pp, zero, virtual)
    trainer = _trainer(strategy, STEPS)  # max_steps reached: fit restores and stops at once
    trainer.fit(TinyLM(), train_dataloaders=_loader(), ckpt_path=str(Path(root) / "ckpt"))
    assert trainer.global_step == STEPS
    trainer.save_checkpoint(Path(root) / f"again-{tp}-{pp}-{zero}", update_last=False)  # what it now holds


def _one_process(ckpt: Path) -> dict:
    """Weights + torch.optim state of a checkpoint, as one process loads them."""
    model, optim = full_state(ckpt, TinyLM(), STEPS)
    return {"model": model, "optim": optim}


def _assert_same(ref: dict, got: dict) -> None:
    assert ref["model"].keys() == got["model"].keys()
    for name, tensor in ref["model"].items():
        assert torch.equal(tensor, got["model"][name]), name
    for r, g in zip(ref["optim"], got["optim"], strict=True):
        assert r["param_groups"] == g["param_groups"]
        assert r["state"].keys() == g["state"].keys() and r["state"]
        for idx, entry in r["state"].items():
            assert entry.keys() == g["state"][idx].keys()
            for key, value in entry.items():
                assert torch.equal(value, g["state"][idx][key]), (idx, key)


def _roundtrip(root: Path, src: tuple[int, ...], dst: tuple[int, ...]) -> dict:
    """(tp, pp, dp, zero[, pp_virtual]) -> another layout."""
    tp, pp, dp, zero, v = (*src, 1)[:5]
    run_distributed(_save_worker, tp * pp * dp, tp, pp, zero, v, str(root), timeout=300, pg_timeout=90)
    tp2, pp2, dp2, zero2, v2 = (*dst, 1)[:5]
    run_distributed(_load_worker, tp2 * pp2 * dp2, tp2, pp2, zero2, v2, str(root), timeout=300, pg_timeout=90)
    ref = _one_process(root / "ckpt")
    _assert_same(ref, _one_process(root / f"again-{tp2}-{pp2}-{zero2}"))
    return ref


def test_tp2_pp2_dp2_zero1_resumes_at_one_process(tmp_path: Path) -> None:
    ref = _roundtrip(tmp_path, (2, 2, 2, 1), (1, 1, 1, 0))
    ckpt = tmp_path / "ckpt"
    index = json.loads((ckpt / "index.json").read_text())
    assert index["topology"] == {
        "tp": 2, "pp": 2, "cp": 1, "dp": 2, "world_size": 8, "zero_stage": 1, "sequence_parallel": False,
    }  # fmt: skip
    # each rank wrote what it owns: weights per (pp, tp), optimizer state per rank (ZeRO: 1/dp)
    assert sorted(p.name for p in ckpt.glob("model-*")) == [
        f"model-pp{p:02d}-tp{t:02d}.safetensors" for p in range(2) for t in range(2)
    ]
    assert len(list(ckpt.glob("optim-*"))) == 8 and len(list(ckpt.glob("rank-*.pt"))) == 8
    moments = [e for n, e in index["tensors"].items() if n.endswith("/exp_avg")]
    shards = [s for e in moments for s in e["shards"]]
    assert all(s["flat"] is not None for s in shards)  # ZeRO-1 partitions: flat pieces
    assert {(s["pp"], s["tp"], s["dp"]) for s in shards} == {
        (p, t, d) for p in (0, 1) for t in (0, 1) for d in (0, 1)
    }
    qkv = index["tensors"]["optim/0/model.model.layers.0.self_attn.qkv_proj.weight/exp_avg"]
    assert {s["tp"] for s in qkv["shards"]} == {0, 1} and all(s["tp_dim"] == 0 for s in qkv["shards"])
    assert "model/model.lm_head.weight" in index["aliases"]  # tied: stored once
    # a single device (no Parallel3DStrategy) reads it as well
    trainer = _trainer(SingleDeviceStrategy("cpu"), STEPS)
    module = TinyLM()
    trainer.fit(module, train_dataloaders=_loader(), ckpt_path=str(ckpt))
    for name, tensor in module.state_dict().items():
        assert torch.equal(tensor, ref["model"][name]), name
    _assert_same(ref, {"model": module.state_dict(), "optim": [trainer.optimizers[0].state_dict()]})
    assert CheckpointReader.open(ckpt).model_state().keys() == ref["model"].keys()


@pytest.mark.slow
def test_tp2_pp2_dp2_zero1_resumes_at_tp4_dp2_zero1(tmp_path: Path) -> None:
    _roundtrip(tmp_path, (2, 2, 2, 1), (4, 1, 2, 1))


def test_dp4_zero1_resumes_at_tp2_pp2_without_zero(tmp_path: Path) -> None:
    _roundtrip(tmp_path, (1, 1, 4, 1), (2, 2, 1, 0))


@pytest.mark.slow
def test_pp2_dp2_zero1_resumes_at_dp4_zero1(tmp_path: Path) -> None:
    _roundtrip(tmp_path, (1, 2, 2, 1), (1, 1, 4, 1))


def test_pp2_v2_resumes_at_pp4(tmp_path: Path) -> None:
    """Rank 0 of (pp=2, v=2) holds layers 0 and 2: each lands on its own rank at pp=4."""
    _roundtrip(tmp_path, (1, 2, 1, 0, 2), (1, 4, 1, 0))
    tensors = json.loads((tmp_path / "ckpt" / "index.json").read_text())["tensors"]
    stage = {
        i: tensors[f"model/model.model.layers.{i}.mlp.down_proj.weight"]["shards"][0]["pp"] for i in range(4)
    }
    assert stage == {0: 0, 1: 1, 2: 0, 3: 1}  # chunk g on rank g mod p


@pytest.mark.slow
def test_pp4_resumes_at_pp2_v2(tmp_path: Path) -> None:
    _roundtrip(tmp_path, (1, 4, 1, 0), (1, 2, 1, 0, 2))


@pytest.mark.slow
def test_pp2_v2_dp2_zero1_resumes_at_one_process(tmp_path: Path) -> None:
    _roundtrip(tmp_path, (1, 2, 2, 1, 2), (1, 1, 1, 0))


def test_one_process_resumes_at_tp2_dp2_zero1_gate_up_in_halves(tmp_path: Path) -> None:
    """gate_up's rows are [gate | up] and tp rank k holds [gate_k | up_k]: two blocks of the global
    tensor, written as two shards (weights and each ZeRO-1 piece), read back from one block."""
    _roundtrip(tmp_path, (1, 1, 1, 0), (2, 1, 2, 1))
    index = json.loads((tmp_path / "again-2-1-1" / "index.json").read_text())
    inter = _config().intermediate_size
    weight = index["tensors"]["model/model.model.layers.0.mlp.gate_up_proj.weight"]
    assert sorted((s["tp"], s["offset"][0], s["shape"][0]) for s in weight["shards"]) == [
        (0, 0, inter // 2), (0, inter, inter // 2), (1, inter // 2, inter // 2), (1, 3 * inter // 2, inter // 2),
    ]  # fmt: skip
    moment = index["tensors"]["optim/0/model.model.layers.0.mlp.gate_up_proj.weight/exp_avg"]
    assert {(s["tp"], s["offset"][0]) for s in moment["shards"]} == {
        (0, 0), (0, inter), (1, inter // 2), (1, 3 * inter // 2),
    }  # fmt: skip
