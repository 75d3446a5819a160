"""Checkpoints under faults, one process: the end of a run is saved; temporary directories of
killed saves are removed at start-up; a truncated or bit-flipped file is an error naming it and
the newest intact checkpoint; files are readable by the group (the umask's mode); a full disk
names the file and the bytes, publishes nothing and keeps `last`."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from _trainer_helpers import MLPModule, loader, make_data

from nanolight.callbacks import ModelCheckpoint
from nanolight.checkpoint import CheckpointError
from nanolight.trainer import NanoTrainer


def _fit(root: Path, max_steps: int, every: int = 2, ckpt_path: str | None = None,
         filename: str = "step-{step}") -> NanoTrainer:  # fmt: skip
    trainer = NanoTrainer(
        max_steps=max_steps, accumulate_grad_batches=2, default_root_dir=root, logger=False,
        enable_progress_bar=False, callbacks=[ModelCheckpoint(every_n_train_steps=every, save_on_train_end=True, save_top_k=-1, filename=filename, auto_insert_metric_name=filename != "step-{step}")],
    )  # fmt: skip
    trainer.fit(MLPModule(scheduler=True), loader(make_data(64), 4), ckpt_path=ckpt_path)
    return trainer


def test_the_last_step_is_saved_and_stale_temporaries_removed(tmp_path: Path) -> None:
    ckpts = tmp_path / "checkpoints"
    stale = ckpts / ".tmp-step-9-4242"  # what a SIGKILLed save of an earlier version left
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"x" * 1000)
    _fit(tmp_path, max_steps=5)
    assert sorted(p.name for p in ckpts.iterdir()) == ["last", "step-2", "step-4", "step-5"]
    assert (ckpts / "last").read_text().strip() == "step-5"


def _damage(file: Path, how: str) -> None:
    data = file.read_bytes()
    if how == "truncate":
        file.write_bytes(data[: len(data) // 2])
    else:  # one flipped bit in the data, size and header intact
        pos = len(data) - 10
        file.write_bytes(data[:pos] + bytes([data[pos] ^ 1]) + data[pos + 1 :])


@pytest.mark.parametrize(
    ("name", "how", "message"),
    [
        ("model-pp00-tp00.safetensors", "truncate", "is truncated or damaged"),
        ("optim-pp00-tp00-dp00.safetensors", "truncate", "is truncated or damaged"),
        ("model-pp00-tp00.safetensors", "flip", "is damaged: its checksum differs"),
        ("trainer_state.pt", "flip", "is damaged: its checksum differs"),
        ("rank-00000.pt", "flip", "is damaged: its checksum differs"),
    ],
)
def test_a_damaged_file_is_named_with_the_newest_intact_checkpoint(
    tmp_path: Path, name: str, how: str, message: str
) -> None:
    _fit(tmp_path, max_steps=4)
    step4 = tmp_path / "checkpoints" / "step-4"
    _damage(step4 / name, how)
    with pytest.raises(CheckpointError, match=message) as info:
        _fit(tmp_path, max_steps=6, ckpt_path=str(step4))
    assert str(step4 / name) in str(info.value)
    assert f"the newest intact checkpoint is {tmp_path / 'checkpoints' / 'step-2'}" in str(info.value)


def test_the_newest_intact_checkpoint_is_found_under_lightning_names(tmp_path: Path) -> None:
    _fit(tmp_path, max_steps=4, filename="{epoch}-{step}")  # Lightning's epoch=0-step=2, epoch=0-step=4
    step4 = tmp_path / "checkpoints" / "epoch=0-step=4"
    _damage(step4 / "model-pp00-tp00.safetensors", "truncate")
    with pytest.raises(CheckpointError, match="is truncated or damaged") as info:
        _fit(tmp_path, max_steps=6, ckpt_path=str(step4), filename="{epoch}-{step}")
    assert f"the newest intact checkpoint is {tmp_path / 'checkpoints' / 'epoch=0-step=2'}" in str(info.value)


def test_files_have_the_umask_mode(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        _fit(tmp_path, max_steps=2)
    finally:
        os.umask(old)
    for file in (tmp_path / "checkpoints" / "step-2").iterdir():
        assert file.stat().st_mode & 0o777 == 0o644, file  # safetensors alone writes 0600


@pytest.fixture
def small_disk(tmp_path: Path):  # noqa: ANN201
    """A 1.5 MB tmpfs: a real full disk (needs the permission to mount, as root in CI has)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1536k", "tmpfs", str(mount)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a tmpfs here")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


class BigMLP(MLPModule):
    """0.3 MB of weights: one checkpoint (weights + Adam moments, ~1 MB) fits in 1.5 MB, two do not."""

    def configure_model(self) -> None:
        if self.model is None:
            torch.manual_seed(0)
            self.model = torch.nn.Sequential(
                torch.nn.Linear(8, 8000), torch.nn.Tanh(), torch.nn.Linear(8000, 1)
            )


def test_a_full_disk_names_the_file_and_keeps_last(small_disk: Path) -> None:
    trainer = NanoTrainer(
        max_steps=4, default_root_dir=small_disk, logger=False, enable_progress_bar=False,
        callbacks=[ModelCheckpoint(every_n_train_steps=2, keep_last_n=5, filename="step-{step}", auto_insert_metric_name=False)],
    )  # fmt: skip
    with pytest.raises(
        CheckpointError, match="disk full writing .* bytes needed, .* free on that filesystem"
    ) as info:
        trainer.fit(BigMLP(), loader(make_data(64), 4))
    assert "`last` still points at step-2" in str(info.value)
    ckpts = small_disk / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["last", "step-2"]  # the temporary directory is gone
    shutil.rmtree(ckpts / "step-2")


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            lambda d: (d / "trainer_state.pt").unlink(),
            r"checkpoint file .*step-4/trainer_state.pt is missing",
        ),
        (
            lambda d: (d / "model-pp00-tp00.safetensors").unlink(),
            r"checkpoint file .*step-4/model-pp00-tp00.safetensors is missing",
        ),
        (lambda d: (d / "index.json").unlink(), r"step-4 has no index.json: .*model.safetensors"),
        (
            lambda d: (d / "index.json").write_bytes((d / "index.json").read_bytes()[:20]),
            r"checkpoint index .*step-4/index.json is unreadable",
        ),
        (
            lambda d: (d / "index.json").write_bytes(b"\xc7\xff" + os.urandom(60)),
            r"checkpoint index .*step-4/index.json is unreadable",
        ),
    ],
    ids=["no-trainer-state", "no-weights", "no-index", "index-truncated", "index-garbage"],
)
def test_a_missing_or_garbled_file_is_named_with_the_newest_intact_checkpoint(
    tmp_path: Path, damage, message: str
) -> None:
    """Resuming from the damaged step or from `last` (which points at it) names what is wrong and
    the intact step-2 -- never "resume from `last`", never a raw JSON/Unicode/scheduler-count error."""
    _fit(tmp_path, max_steps=4)
    damage(tmp_path / "checkpoints" / "step-4")
    for ckpt_path in (str(tmp_path / "checkpoints" / "step-4"), "last"):
        with pytest.raises(CheckpointError, match=message) as info:
            _fit(tmp_path, max_steps=6, ckpt_path=ckpt_path)
        text = str(info.value)
        assert f"the newest intact checkpoint is {tmp_path / 'checkpoints' / 'step-2'}" in text
        assert "`last`" not in text and "\n" not in text


def test_a_non_utf8_index_is_named(tmp_path: Path) -> None:
    from nanolight.checkpoint.reader import CheckpointReader

    (tmp_path / "index.json").write_bytes(b'{"format": "\xff\xfe garbage')
    with pytest.raises(CheckpointError, match=r"checkpoint index .*index.json is unreadable"):
        CheckpointReader.open(tmp_path)
