"""`validate`, `log` semantics and checkpoint file format."""

from __future__ import annotations

import json
import zlib

import pytest
import torch
from _trainer_helpers import MLPModule, loader, make_data

from nanolight.callbacks import ModelCheckpoint
from nanolight.checkpoint import CheckpointReader
from nanolight.trainer import NanoTrainer


def _trainer(tmp_path, **kw) -> NanoTrainer:
    kw.setdefault("logger", False)
    return NanoTrainer(enable_progress_bar=False, default_root_dir=tmp_path, **kw)


def test_validate_from_checkpoint(tmp_path):
    ds = make_data(32)
    trained = MLPModule()
    _trainer(
        tmp_path,
        max_steps=4,
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "checkpoints", every_n_train_steps=4)],
    ).fit(trained, loader(ds, 4))
    with torch.no_grad():
        expected = torch.stack([trained.loss(b) for b in loader(ds, 8)]).mean()
    # another trainer has no ModelCheckpoint with a last_model_path: name the `last` pointer itself
    metrics = _trainer(tmp_path, enable_checkpointing=False).validate(
        MLPModule(), loader(ds, 8), ckpt_path=tmp_path / "checkpoints" / "last"
    )
    assert metrics == [{"val/loss": pytest.approx(float(expected), abs=1e-6)}]  # one dict per dataloader


class StepEpochLogger(MLPModule):
    def training_step(self, batch, batch_idx):
        self.log("mb_index", float(batch_idx), on_step=True, on_epoch=True)
        self.log("synced", 2.0, sync_dist=True, prog_bar=True)
        return super().training_step(batch, batch_idx)


def test_log_means_over_micro_batches_and_epoch(tmp_path):
    trainer = _trainer(tmp_path, max_steps=2, accumulate_grad_batches=4, enable_checkpointing=False)
    trainer.fit(StepEpochLogger(), loader(make_data(64), 2))
    m = trainer.callback_metrics
    assert float(m["mb_index_step"]) == 7.0  # Lightning: the step's last micro-batch (4..7)
    assert float(m["mb_index_epoch"]) == 3.5  # the mean over all micro-batches 0..7
    assert float(trainer.progress_bar_metrics["synced"]) == 2.0


def test_checkpoint_files_are_weights_only(tmp_path):
    _trainer(tmp_path, max_steps=2, accumulate_grad_batches=2).fit(
        MLPModule(scheduler=True), loader(make_data(32), 4)
    )
    # the default ModelCheckpoint (as Lightning): no logger -> <root>/checkpoints, at the epoch's end
    ckpt = tmp_path / "checkpoints" / "epoch=0-step=2"
    # one process writes the one-shard case of the sharded format: its files, then the index
    names = ["model-pp00-tp00.safetensors", "optim-pp00-tp00-dp00.safetensors", "optimizer_groups.pt"]
    names += ["rank-00000.pt", "trainer_state.pt"]
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(["index.json", *names])
    index = json.loads((ckpt / "index.json").read_text())  # what was written, checked at load
    assert sorted(index["files"]) == sorted(index["checksums"]) == sorted(names)
    for name in names:
        data = (ckpt / name).read_bytes()
        assert (index["files"][name], index["checksums"][name]) == (len(data), f"{zlib.crc32(data):08x}")
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    assert state["progress"]["global_step"] == 2 and state["progress"]["batch_idx"] == 4
    assert {"python", "numpy", "torch"} <= set(state["rng"])
    assert CheckpointReader.open(ckpt).names("optim/0/")
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_empty_loader_stops_fit_with_a_warning(tmp_path):
    trainer = _trainer(tmp_path, max_steps=2)
    with pytest.warns(UserWarning, match="the train dataloader has no batches"):
        trainer.fit(MLPModule(), [])  # as Lightning: fit stops (with a word, not silently)
    assert trainer.global_step == 0


def test_unsized_loader_without_batches_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="yielded no batches"):
        _trainer(tmp_path, max_steps=2).fit(MLPModule(), iter([]))


class DeterminismProbe(MLPModule):
    def on_train_start(self) -> None:
        self.was_on = torch.are_deterministic_algorithms_enabled()


def test_seed_and_deterministic(tmp_path):
    runs = []
    for _ in range(2):
        module = DeterminismProbe()
        trainer = _trainer(tmp_path, max_steps=3, seed=7, deterministic=True, enable_checkpointing=False)
        trainer.fit(module, torch.utils.data.DataLoader(make_data(32), batch_size=4, shuffle=True))
        runs.append([p.detach().clone() for p in module.parameters()])
        assert module.was_on and not torch.are_deterministic_algorithms_enabled()
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))  # seeded shuffle -> same run
