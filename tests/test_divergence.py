"""A diverging run stops, says where, and keeps its last finite checkpoint ("nothing lost", item 1).

The recipe installs `DivergenceCheck` (`trainer.stop_on_divergence`, default true): a non-finite
loss or grad norm ends the run with one line naming the first bad step and the last finite
checkpoint, exit status 1, and no checkpoint of the non-finite state is written, so rotation
(`keep_last_n`) cannot delete the newest finite one. It reads its record only where the step
reads values anyway (`test_sync_free.py` runs the recipe's trainer with it)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _trainer_helpers import MLPModule, loader, make_data
from test_recipe_e2e import BASE_OVERRIDES, REPO

from nanolight import load_pretrained
from nanolight.callbacks import ModelCheckpoint
from nanolight.trainer import NanoTrainer


class NaNFrom(MLPModule):
    """The loss is NaN at step `bad` (so are the gradients, then the weights)."""

    def __init__(self, bad: int) -> None:
        super().__init__()
        self.bad = bad

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.trainer.global_step + 1 == self.bad else loss


def test_trainer_refuses_to_save_a_non_finite_step(tmp_path: Path) -> None:
    from nanolight.callbacks import DivergenceCheck
    from nanolight.errors import TrainingDiverged

    ckpt = ModelCheckpoint(
        every_n_train_steps=1, keep_last_n=1, filename="step-{step}", auto_insert_metric_name=False
    )
    trainer = NanoTrainer(
        max_steps=8, log_every_n_steps=4, callbacks=[DivergenceCheck(), ckpt], logger=False,
        enable_progress_bar=False, default_root_dir=tmp_path,
    )  # fmt: skip
    with pytest.raises(
        TrainingDiverged, match=r"not finite from step 3 .*last finite checkpoint is .*step-2"
    ):
        trainer.fit(NaNFrom(3), loader(make_data(64), 4))
    ckpt_dir = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["last", "step-2"]  # step 3 never written
    assert trainer.global_step == 3 and trainer.state.status == "interrupted"


def test_finite_run_is_untouched(tmp_path: Path) -> None:
    from nanolight.callbacks import DivergenceCheck

    trainer = NanoTrainer(
        max_steps=4, log_every_n_steps=1, callbacks=[DivergenceCheck()], logger=False,
        enable_progress_bar=False, default_root_dir=tmp_path, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(MLPModule(), loader(make_data(32), 4))
    assert trainer.global_step == 4


# ---- through the recipe ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The recipe's data cache (corpus, tokenizer, tokens), built by the first run, read by the second."""
    return tmp_path_factory.mktemp("nanolight-cache")


def _recipe(run_dir: Path, cache: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO / "recipes" / "smollm.py"), f"trainer.default_root_dir={run_dir}",
           f"data.cache_dir={cache}", *BASE_OVERRIDES, "logger=csv", "trainer.enable_progress_bar=false",
           *overrides]  # fmt: skip
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env, cwd=run_dir.parent)


def _finite(step_dir: Path) -> bool:
    return all(torch.isfinite(p).all() for p in load_pretrained(step_dir).parameters())


@pytest.mark.slow
def test_recipe_diverging_run_stops_and_keeps_the_last_finite_checkpoint(
    tmp_path: Path, cache_dir: Path
) -> None:
    run = tmp_path / "run"
    proc = _recipe(
        run, cache_dir, "trainer.max_steps=16", "checkpoint.every_n_steps=2", "checkpoint.keep_last_n=2",
        "optim.lr=20", "trainer.log_every_n_steps=4",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("nanolight: error:")]
    assert len(lines) == 1 and "training diverged" in lines[0], proc.stderr[-3000:]
    step = int(re.search(r"not finite from step (\d+)", lines[0]).group(1))
    ckpt_dir = run / "checkpoints"
    last = (ckpt_dir / "last").read_text().strip()
    assert f"last finite checkpoint is {ckpt_dir / last}" in lines[0]
    kept = sorted(int(p.name.removeprefix("step-")) for p in ckpt_dir.glob("step-*"))
    assert kept and max(kept) < step and f"step-{max(kept)}" == last, (kept, step)
    assert all(_finite(ckpt_dir / f"step-{s}") for s in kept)


@pytest.mark.slow
def test_recipe_nan_from_the_first_step_saves_nothing(tmp_path: Path, cache_dir: Path) -> None:
    run = tmp_path / "run"
    # one token per row: no position has a target, the token mean is 0/0
    proc = _recipe(run, cache_dir, "trainer.max_steps=4", "checkpoint.every_n_steps=2", "trainer.seq_len=1",
                   "optim.lr=1e9")  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("nanolight: error:")]
    assert "not finite from step 1 " in line and "no finite checkpoint was saved" in line, line
    assert not list((run / "checkpoints").glob("step-*")) if (run / "checkpoints").exists() else True
