"""`TrainerConfig`: NanoTrainer's loop options, validated with fix-it messages."""

from __future__ import annotations

from dataclasses import dataclass

from nanolight.errors import UsageError


@dataclass
class TrainerConfig:
    """Loop knobs. ``val_check_interval`` counts *optimizer steps* (pretraining has no epochs to
    speak of); None validates once at the end of every epoch. ``limit_val_batches`` is a count
    (int) or a fraction (float) of the validation loader."""

    max_steps: int = -1
    max_epochs: int | None = None
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None
    val_check_interval: int | None = None
    limit_val_batches: int | float = 1.0
    log_every_n_steps: int = 50
    fast_dev_run: int | bool = False
    seed: int | None = None
    deterministic: bool = False

    def __post_init__(self) -> None:
        if self.accumulate_grad_batches < 1:
            raise UsageError(f"accumulate_grad_batches must be >= 1, got {self.accumulate_grad_batches}")
        if self.gradient_clip_val is not None and self.gradient_clip_val <= 0:
            raise UsageError(f"gradient_clip_val must be > 0 or None, got {self.gradient_clip_val}")
        if self.val_check_interval is not None and (
            not isinstance(self.val_check_interval, int) or self.val_check_interval < 1
        ):
            raise UsageError(
                f"val_check_interval counts optimizer steps: use an int >= 1 or None (end of epoch), "
                f"got {self.val_check_interval!r}"
            )
        if self.log_every_n_steps < 1:
            raise UsageError(f"log_every_n_steps must be >= 1, got {self.log_every_n_steps}")
        if isinstance(self.limit_val_batches, float) and not 0.0 <= self.limit_val_batches <= 1.0:
            raise UsageError(
                f"limit_val_batches as a float is a fraction in [0, 1], got {self.limit_val_batches}"
            )
        if self.fast_dev_run:
            n = 1 if self.fast_dev_run is True else int(self.fast_dev_run)
            if n < 1:
                raise UsageError(f"fast_dev_run must be True or an int >= 1, got {self.fast_dev_run!r}")
            self.max_steps, self.max_epochs, self.limit_val_batches = n, 1, n
            self.val_check_interval, self.log_every_n_steps = n, 1
        if self.max_steps == -1 and self.max_epochs is None:
            self.max_epochs = 1000  # Lightning's default when neither limit is given

    def val_batches(self, loader_len: int | None) -> int | None:
        """How many validation batches to run (None = all of an unsized loader)."""
        lim = self.limit_val_batches
        if isinstance(lim, float):
            if loader_len is None:
                return None if lim == 1.0 else 0
            return int(loader_len * lim)
        return lim if loader_len is None else min(lim, loader_len)
