"""Training script for the SIGKILL-resume test: ``python _resume_run.py ROOT MAX_STEPS KILL_AT|0 RESUME|-``.

Appends ``step loss.hex()`` lines to ROOT/losses.txt (flushed per step), saves the final
weights to ROOT/final.pt. With KILL_AT=k it SIGKILLs itself in the middle of step k+1 (after
the step-k checkpoint was written): no cleanup, no atexit, like a node failure.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).parent))
from _trainer_helpers import MLPModule, make_data  # noqa: E402

from nanolight.callbacks import Callback, ModelCheckpoint  # noqa: E402
from nanolight.trainer import NanoTrainer  # noqa: E402


class DropoutMLP(MLPModule):
    """Dropout makes the run depend on the torch RNG, so RNG restore is tested too."""

    def configure_model(self) -> None:
        if self.model is None:
            torch.manual_seed(0)
            self.model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.2), nn.Linear(32, 1))


class Recorder(Callback):
    def __init__(self, root: Path, kill_at: int) -> None:
        self.file = open(root / "losses.txt", "a")  # noqa: SIM115
        self.kill_at = kill_at
        self.step = 0

    def on_train_start(self, trainer, pl_module) -> None:
        self.step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self.step:  # the last micro-batch of a step: after its update
            self.step = trainer.global_step
            self.file.write(f"{trainer.global_step} {float(trainer.step_loss).hex()}\n")
            self.file.flush()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.kill_at and trainer.global_step == self.kill_at:
            assert (Path(trainer.default_root_dir) / "checkpoints" / f"step-{self.kill_at}").is_dir()
            os.kill(os.getpid(), signal.SIGKILL)


def run(root: Path, max_steps: int, kill_at: int, resume: str) -> None:
    root.mkdir(parents=True, exist_ok=True)
    train = DataLoader(make_data(64), batch_size=4, shuffle=True)
    trainer = NanoTrainer(
        max_steps=max_steps, accumulate_grad_batches=2, gradient_clip_val=1.0, seed=1234,
        callbacks=[Recorder(root, kill_at), ModelCheckpoint(every_n_train_steps=3, keep_last_n=2, filename="step-{step}", auto_insert_metric_name=False)],
        logger=False, enable_progress_bar=False, default_root_dir=root,
    )  # fmt: skip
    module = DropoutMLP(lr=0.02, scheduler=True)
    trainer.fit(module, train, ckpt_path=None if resume == "-" else resume)
    torch.save(module.state_dict(), root / "final.pt")


if __name__ == "__main__":
    run(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
