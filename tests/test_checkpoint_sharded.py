"""The sharded checkpoint format and its failure modes: any block of any tensor reads back from
tp blocks and ZeRO flat pieces; a missing, truncated or unindexed file is an error naming it; a
checkpoint of another model is refused naming the tensors; a rank that fails to write makes
every rank fail (no hang) and publishes nothing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from _dist import run_distributed
from safetensors import SafetensorError
from test_checkpoint_reshard import TinyLM, _config, _loader, _trainer

from nanolight.checkpoint import INDEX_FILE, CheckpointError, CheckpointReader, atomic
from nanolight.checkpoint.save import ShardWriter, merge_parts, write_index
from nanolight.models import LlamaForCausalLM
from nanolight.strategies.parallel3d import Parallel3DStrategy


def _write_layout(root: Path, full: torch.Tensor, tp: int, dp: int) -> None:
    """`full` stored as tp row blocks, each block's flattening cut into dp uneven flat pieces."""
    parts = []
    rows = full.shape[0] // tp
    for t in range(tp):
        block = full[t * rows : (t + 1) * rows]
        flat = block.reshape(-1)
        cuts = [0, *sorted(torch.randperm(flat.numel() - 1)[: dp - 1].add(1).tolist()), flat.numel()]
        for d in range(dp):
            writer = ShardWriter({"pp": 0, "tp": t, "dp": d})
            a, b = cuts[d], cuts[d + 1]
            name = "optim/0/w/exp_avg"
            writer.add(
                f"o{t}{d}.safetensors",
                name,
                flat[a:b],
                list(full.shape),
                [t * rows, 0],
                list(block.shape),
                (a, b),
                0,
            )
            if d == 0:
                writer.add(f"m{t}.safetensors", "model/w", block, list(full.shape), [t * rows, 0], tp_dim=0)
            parts.append(writer.write(root))
    write_index(root, merge_parts(parts, {"tp": tp, "dp": dp}, {"model/tied": "model/w"}))


def test_any_block_reads_back_from_tp_blocks_and_zero_pieces(tmp_path: Path) -> None:
    torch.manual_seed(0)
    full = torch.randn(12, 10)
    _write_layout(tmp_path, full, tp=3, dp=3)
    reader = CheckpointReader.open(tmp_path)
    for name in ("model/w", "optim/0/w/exp_avg", "model/tied"):
        assert torch.equal(reader.read(name), full)
        for offset, shape in (([0, 0], [12, 5]), ([3, 2], [6, 7]), ([11, 9], [1, 1]), ([2, 0], [8, 10])):
            block = full[offset[0] : offset[0] + shape[0], offset[1] : offset[1] + shape[1]]
            assert torch.equal(reader.read(name, offset, shape), block), (name, offset, shape)
    assert set(reader.model_state()) == {"w", "tied"}
    with pytest.raises(ValueError, match="outside the stored shape"):
        reader.read("model/w", [10, 0], [4, 10])
    with pytest.raises(KeyError, match="holds no tensor 'model/nope'"):
        reader.read("model/nope")


def test_ownership_bug_is_caught_at_save(tmp_path: Path) -> None:
    writer = ShardWriter({"pp": 0, "tp": 0, "dp": 0})
    writer.add("m.safetensors", "model/w", torch.zeros(2, 4), [4, 4], [0, 0], tp_dim=0)  # half of it
    with pytest.raises(RuntimeError, match=r"incomplete: model/w: 8 of 16 elements"):
        merge_parts([writer.write(tmp_path)], {}, {})


def test_missing_truncated_or_unindexed_files_are_named(tmp_path: Path) -> None:
    _write_layout(tmp_path, torch.randn(4, 4), tp=2, dp=2)
    shard = tmp_path / "o11.safetensors"
    data = shard.read_bytes()
    os.truncate(shard, len(data) - 7)
    reader = CheckpointReader.open(tmp_path)  # a rank verifies a file when it first reads it
    with pytest.raises(
        ValueError, match=rf"{shard} is truncated or damaged: {len(data) - 7} bytes, {len(data)}"
    ):
        reader.read("optim/0/w/exp_avg")
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=rf"{shard} is missing"):
        CheckpointReader.open(tmp_path).read("optim/0/w/exp_avg")
    shard.write_bytes(b"\xff" * len(data))  # right size, garbage header: the checksum catches it
    with pytest.raises(ValueError, match=rf"file {shard} is damaged: its checksum differs"):
        CheckpointReader.open(tmp_path).read("optim/0/w/exp_avg")
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    (tmp_path / INDEX_FILE).write_text(
        json.dumps({**index, "checksums": {}})
    )  # an index from before checksums
    with pytest.raises(ValueError, match=rf"shard {shard} is unreadable"):
        CheckpointReader.open(tmp_path).read("optim/0/w/exp_avg")
    (tmp_path / INDEX_FILE).write_text('{"format": "nanolight-sharded-v2", "tens')
    with pytest.raises(ValueError, match=r"index .* is unreadable"):
        CheckpointReader.open(tmp_path)
    (tmp_path / INDEX_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="no index.json: not a complete checkpoint"):
        CheckpointReader.open(tmp_path)


class WiderLM(TinyLM):
    def configure_model(self) -> None:
        if self.model is None:
            cfg = _config()
            cfg.intermediate_size = 192
            self.model = LlamaForCausalLM(cfg)


def _mismatch_worker(rank: int, world: int, root: str) -> str:
    trainer = _trainer(Parallel3DStrategy(tp=world), 1)
    trainer.fit(TinyLM(), train_dataloaders=_loader())
    trainer.save_checkpoint(Path(root) / "ckpt", update_last=False)
    other = _trainer(Parallel3DStrategy(tp=world), 1)
    try:
        other.fit(WiderLM(), train_dataloaders=_loader(), ckpt_path=str(Path(root) / "ckpt"))
    except ValueError as exc:
        return str(exc)
    return "loaded"


def test_checkpoint_of_another_model_is_refused(tmp_path: Path) -> None:
    errors = run_distributed(_mismatch_worker, 2, str(tmp_path), timeout=180, pg_timeout=60)
    assert errors[0] == errors[1]
    assert "checkpoint does not match the model" in errors[0]
    assert (
        "model.model.layers.0.mlp.gate_up_proj.weight: checkpoint (256, 64) vs model (384, 64)" in errors[0]
    )


def _failed_write_worker(rank: int, world: int, root: str) -> str:
    trainer = _trainer(Parallel3DStrategy(dp=world, zero_stage=1), 1)
    trainer.fit(TinyLM(), train_dataloaders=_loader())
    trainer.save_checkpoint(Path(root) / "step-1")
    if rank == 1:  # this rank's disk is full: safetensors says so as it does on a real full disk

        def fail(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

        atomic.save_file = fail
    try:
        trainer.save_checkpoint(Path(root) / "step-2")
    except CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "saved"


def test_a_rank_failing_to_write_fails_every_rank_and_publishes_nothing(tmp_path: Path) -> None:
    errors = run_distributed(_failed_write_worker, 2, str(tmp_path), timeout=180, pg_timeout=60)
    assert errors[1].startswith(
        f"DiskFullError: disk full writing {tmp_path / '.tmp-step-2'}/optim-pp00-tp00-dp01"
    )
    assert "bytes needed" in errors[1] and "`last` still points at step-1" in errors[1]
    assert errors[0].startswith(
        "CheckpointError: checkpoint save failed: rank 1 failed writing its checkpoint shards"
    )
    assert "nothing of step-2 was published, `last` still points at step-1" in errors[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "last",
        "step-1",
    ]  # no step-2, no temporary directory


def _from_pretrained_worker(rank: int, world: int, root: str) -> dict:
    trainer = _trainer(Parallel3DStrategy(tp=world, pretrained=str(Path(root) / "hf-init")), 1)
    trainer.fit(TinyLM(), train_dataloaders=_loader())
    trainer.save_checkpoint(Path(root) / "step-1")
    return json.loads((Path(root) / "step-1" / "config.json").read_text())


def test_step_directory_is_a_model_directory_that_keeps_hf_token_ids(tmp_path: Path) -> None:
    from nanolight import load_pretrained, save_pretrained

    model = LlamaForCausalLM(_config())
    model.init_weights(torch.Generator().manual_seed(0))
    save_pretrained(model, tmp_path / "hf-init", hf_extra={"bos_token_id": 1, "eos_token_id": 2})
    meta = run_distributed(_from_pretrained_worker, 2, str(tmp_path), timeout=180, pg_timeout=60)[0]
    assert meta["hf_extra"] == {"bos_token_id": 1, "eos_token_id": 2}
    assert meta["sharding"] == {"index": "index.json", "prefix": "model."}
    loaded = load_pretrained(tmp_path / "step-1")
    assert loaded.config.hidden_size == 64 and loaded.config.num_key_value_heads == 4


def test_resume_at_another_tp_pp_keeps_each_dp_rank_its_own_data_position(tmp_path: Path) -> None:
    """A data stream's position is per dp rank: at another tp x pp with the same dp, every rank of
    dp coordinate d takes the state saved by dp rank d (at another dp, rank 0's)."""
    from nanolight.checkpoint.atomic import save_torch
    from nanolight.checkpoint.index import CheckpointIndex
    from nanolight.checkpoint.load import trainer_state

    for rank in range(2):  # saved at dp=2, one rank each
        save_torch(
            tmp_path / f"rank-{rank:05d}.pt", {"rng": None, "loop": {"dp": rank}, "coords": {"dp": rank}}
        )
    save_torch(tmp_path / "trainer_state.pt", {"loop": {"dp": 0}, "rng": None})
    topology = {"tp": 1, "pp": 1, "dp": 2, "world_size": 2}
    write_index(tmp_path, CheckpointIndex(topology, {}, {}))
    reader = CheckpointReader.open(tmp_path)
    at_tp2 = {"tp": 2, "pp": 1, "dp": 2, "world_size": 4}
    assert [trainer_state(reader, r, at_tp2, dp_rank=r // 2)["loop"] for r in range(4)] == [
        {"dp": 0}, {"dp": 0}, {"dp": 1}, {"dp": 1}
    ]  # fmt: skip
    at_dp4 = {"tp": 1, "pp": 1, "dp": 4, "world_size": 4}
    assert all(trainer_state(reader, r, at_dp4, dp_rank=r)["loop"] == {"dp": 0} for r in range(4))
