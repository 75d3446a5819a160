"""What a recipe run tells its user beyond the progress lines: where the curve starts, where it
ended, and what to type next.

- `EdgeValidations`: a validation pass before step 1 (the untrained model's loss, ~ln(vocab), and
  bits per byte: the point a curve starts from) and after the last step, also off the schedule
  (the final figures); the last step's line and row are written whatever `log_every_n_steps`. Lightning has no validation before training beyond its
  sanity check, so this is the recipe's, not `NanoTrainer`'s: a plain trainer behaves as Lightning's.
- `RunReport`: the summary block printed when a run ends: steps, tokens, wall time, the final
  train and validation loss, bits per byte beside gzip and xz on the same text, where the
  checkpoint and the wandb run are, and the commands that continue, export and load the run --
  this run's own command line, so they work as pasted from the same directory.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from nanolight.callbacks import Callback
from nanolight.callbacks.progress import clock
from nanolight.checkpoint.atomic import atomic_write_text
from nanolight.loggers import WandbLogger
from nanolight.parallel.launcher import detect_environment
from nanolight.pretrain.module import HeldOut
from nanolight.seed import capture_rng_state, restore_rng_state
from nanolight.trainer import NanoTrainer

WANDB_RUN_ID = Path("wandb") / "run-id"  # in the run directory: a resume continues this wandb run
# what the next commands set themselves (a resume with init_from is an error)
NEXT_COMMAND_KEYS = ("checkpoint.resume", "checkpoint.init_from", "trainer.max_steps")


def saved_wandb_id(root: Path) -> str | None:
    """The wandb run id an earlier run in `root` recorded (None: none yet)."""
    try:
        return (root / WANDB_RUN_ID).read_text().strip() or None
    except OSError:
        return None


def converter_script(recipe: str) -> str:
    """scripts/convert_nanolight_to_hf.py beside the recipe's directory (as typed), else beside the
    package's (an editable install)."""
    name = os.path.join("scripts", "convert_nanolight_to_hf.py")
    beside_recipe = os.path.join(os.path.dirname(os.path.dirname(recipe)), name)
    beside_package = str(Path(__file__).resolve().parents[2] / name)
    return (
        beside_recipe
        if os.path.isfile(beside_recipe) or not os.path.isfile(beside_package)
        else beside_package
    )


class EdgeValidations(Callback):
    """Validation before step 1 (a fresh run) and after the last step of ``max_steps`` (the loop's
    own pass, asked for as Lightning's loop does for a stopping run: `should_stop` makes the
    step's validation due, logged in the step's row and epoch like any scheduled one)."""

    def on_train_start(self, trainer: NanoTrainer, pl_module: Any) -> None:
        if trainer.global_step == 0 and trainer.enable_validation:
            rng = capture_rng_state()  # as the sanity check: the pass changes nothing of the training
            trainer.fit_loop.validate()
            restore_rng_state(rng)

    def on_train_batch_end(
        self, trainer: NanoTrainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if 0 < trainer.max_steps <= trainer.global_step:  # the last step's update is done
            trainer.should_stop = True


class RunReport(Callback):
    """Collects the run's figures (global rank zero) for `summary`, printed once the loggers are
    closed (wandb's own lines come before it), and records the wandb run id for a resume."""

    def __init__(self, root: Path, overrides: list[str], started: float, held_out: HeldOut | None) -> None:
        """`root`: the run directory; `overrides`: the run's command line; `started`:
        `time.monotonic()` when the command started; `held_out`: the validation text's size and
        what gzip and xz make of it."""
        self.root, self.overrides, self.started, self.held_out = root, overrides, started, held_out
        env = detect_environment()  # our own launcher re-runs plain python; torchrun/srun are the user's
        self.launcher = "python" if env is None or env.source == "subprocess" else f"<{env.source} as before>"
        self.first_step: int | None = None  # the step this command started training from (None: it did not)
        self.last_step = self.max_steps = self.tokens = 0
        self.stopped_by: str | None = None
        self.train_loss: float | None = None
        self.val: tuple[int, dict[str, float]] | None = None  # (step, values) of the newest validation
        self.wandb: list[str] = []  # where the wandb run is, and how to upload it

    def on_train_start(self, trainer: NanoTrainer, pl_module: Any) -> None:
        self.first_step, self.max_steps = trainer.global_step, trainer.max_steps
        for lg in trainer.loggers if trainer.is_global_zero else []:
            if isinstance(lg, WandbLogger):  # the run exists from here: a resume can continue it
                atomic_write_text(self.root / WANDB_RUN_ID, f"{lg.experiment.id}\n")

    def on_validation_end(self, trainer: NanoTrainer, pl_module: Any) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        keys = ("val/loss", "val/bits_per_byte")
        m = trainer.callback_metrics
        self.val = trainer.global_step, {k: float(m[k]) for k in keys if k in m}

    def on_fit_end(self, trainer: NanoTrainer, pl_module: Any) -> None:
        if self.first_step is None or not trainer.is_global_zero:
            return
        self.last_step, self.tokens = trainer.global_step, trainer.progress["tokens"]
        self.stopped_by = trainer.preempted_by  # a signal (saved, resumable), or None: it ran its course
        loss = trainer.callback_metrics.get("train/loss")
        self.train_loss = float(loss) if loss is not None else None
        for lg in trainer.loggers:
            if isinstance(lg, WandbLogger):
                run = lg.experiment
                where = str(self.root / "wandb" / Path(run.dir).parent.name)  # run.dir: <that>/files
                upload = (
                    f"upload it with: wandb sync {shlex.quote(where)}" if lg.mode == "offline" else run.url
                )
                self.wandb = [where, f"({lg.mode}; {upload})"]

    # ---- the block ---------------------------------------------------------------------
    def summary(self) -> str | None:
        """The block, or None when this command trained nothing (e.g. a finished run resumed)."""
        if self.first_step is None:
            return None
        first, last, root = self.first_step, self.last_step, self.root
        steps = f"steps {first + 1}-{last}" if first else f"{last} steps"
        steps += f" of {self.max_steps}" if self.max_steps > 0 else ""
        lines = [
            f"nanolight: run {'stopped by ' + self.stopped_by if self.stopped_by else 'done'}: {steps}, "
            f"{self.tokens:,} tokens, "
            f"{clock(time.monotonic() - self.started)} wall time (this command)"
        ]
        figures = [f"train loss {self.train_loss:.4f} (step {last})"] if self.train_loss is not None else []
        if self.val is not None:
            step, values = self.val
            if "val/loss" in values:
                figures.append(f"val loss {values['val/loss']:.4f} (step {step})")
            if "val/bits_per_byte" in values and self.held_out is not None:
                h = self.held_out
                figures.append(
                    f"{values['val/bits_per_byte']:.3f} bits per byte of held-out text "
                    f"(gzip -9 {h.gzip_bpb:.3f}, xz -9 {h.xz_bpb:.3f})"
                )
        lines += [f"  {f}" for f in figures]
        last_dir = root / "checkpoints" / "last"
        try:
            newest = f" -> {last_dir.read_text().strip()}"
        except OSError:
            newest = " (none saved)"
        lines.append(f"  checkpoint  {last_dir}{newest}")
        if self.wandb:
            lines.append(f"  wandb       {'  '.join(self.wandb)}")
        lines += ["next:", *(f"  {c}" for c in self.next_commands(last_dir))]
        return "\n".join(lines)

    def next_commands(self, last_dir: Path) -> list[str]:
        """Continue (twice the steps), export, load: this run's overrides, so they work as pasted."""
        script = sys.argv[0] or "recipes/smollm.py"
        kept = [o for o in self.overrides if o.lstrip("+~").split("=", 1)[0] not in NEXT_COMMAND_KEYS]
        more = max(2 * self.max_steps, self.last_step + 1)
        resume = [*kept, "checkpoint.resume=last", f"trainer.max_steps={more}"]
        converter = converter_script(script)
        hf_dir = Path("hf") / (self.root.resolve().name or "model")
        load = f"import nanolight; print(nanolight.load_pretrained({json.dumps(str(last_dir))}).config)"
        return [
            f"continue: {self.launcher} {shlex.join([script, *resume])}",
            f"export:   python {shlex.join([converter, '--checkpoint-path', str(last_dir), '--save-path', str(hf_dir)])}",
            f"load:     python -c {shlex.quote(load)}",
        ]
