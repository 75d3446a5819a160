"""What a run shows while it trains: `RichProgressBar` (steps, loss, tokens/s, ETA) and
`GreedySamples` (the model's greedy continuation of a fixed prompt after each validation).

On a terminal the bar is a rich progress bar; otherwise (CI logs, pipes, ``nohup``) a live bar
would spam or vanish, so it prints one plain line every ``log_every_n_steps`` steps instead, with
the time elapsed and the time left (the bar's own columns). A validation pass prints its values
once, on a line of its own: a step's line shows what that step measured, never an older
validation's. Only global rank zero draws; tokens/s is `StepTimer`'s (validation excluded), the
ETA the wall clock's (validation included: it is part of the time left).

Numbers say a run learns; a sample shows what it learned ("the the the" after 200 steps is a
different run from one that writes plausible code). Sampling works at every layout: each step runs
the whole model (under pipeline parallelism each stage forwards its part), and the next token is
taken from the last stage through `Strategy.reduce`, so every rank continues the same text.
Printed on rank 0 and sent to the loggers (``Logger.log_text``: a W&B table).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from nanolight.callbacks.base import Callback
from nanolight.callbacks.throughput import StepTimer


def clock(seconds: float) -> str:
    """``m:ss``, or ``h:mm:ss`` from an hour up (as rich's time columns)."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class RichProgressBar(StepTimer):
    """Progress over optimizer steps (``max_steps``, or open-ended when it is unset). The step
    count moves every step; loss and tokens/s (over the training time since the previous logging
    step, as `ThroughputMonitor`'s) refresh on logging steps (reading them syncs the device)."""

    def __init__(self, force_plain: bool = False) -> None:
        super().__init__()
        self.force_plain = force_plain
        self._progress: Any = None
        self._task: Any = None
        self._tokens0 = 0
        self._wall0, self._step0 = 0.0, 0  # the wall clock and step when training started
        self._before_eval: dict[str, Any] = {}  # the bar's values when a validation pass started
        self._eval_keys: set[str] = set()  # what validation shows: on its own line, not on a step's

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        super().on_train_start(trainer, pl_module)
        self._wall0, self._step0 = time.monotonic(), trainer.global_step
        if not trainer.is_global_zero or self.force_plain or not sys.stdout.isatty():
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._progress = Progress(
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(),
            TimeRemainingColumn(),
            TextColumn("loss {task.fields[loss]}  tok/s {task.fields[tps]}  {task.fields[extra]}"),
        )
        total = trainer.max_steps if trainer.max_steps > 0 else None
        self._task = self._progress.add_task(
            "train", total=total, completed=trainer.global_step, loss="-", tps="-", extra=""
        )
        self._progress.start()

    def _mark(self, trainer: Any) -> None:
        super()._mark(trainer)
        self._tokens0 = trainer.progress["tokens"]

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=trainer.global_step)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)  # `on_timed` when due

    def on_timed(self, trainer: Any, seconds: float, steps: int) -> None:
        if not trainer.is_global_zero:
            return
        m = {  # syncs: logging steps only
            k: float(v) for k, v in trainer.progress_bar_metrics.items() if k not in self._eval_keys
        }
        loss, tps = m.pop("train/loss", None), (trainer.progress["tokens"] - self._tokens0) / seconds
        fields = {
            "loss": f"{loss:.4f}" if loss is not None else "-",
            "tps": f"{tps:,.0f}" if tps else "-",
            "extra": "  ".join(f"{k}={v:.4g}" for k, v in m.items()),
        }
        if self._progress is not None:
            self._progress.update(self._task, **fields)
            return
        total = f"/{trainer.max_steps}" if trainer.max_steps > 0 else ""
        line = f"step {trainer.global_step}{total}  loss {fields['loss']}  tok/s {fields['tps']}  {self._times(trainer)}"
        print(f"{line}  {fields['extra']}".rstrip(), flush=True)

    def _times(self, trainer: Any) -> str:
        """``elapsed m:ss  ETA m:ss``: the wall clock since training started, and the steps left at
        this run's pace so far (no ETA for an open-ended run)."""
        elapsed, done = time.monotonic() - self._wall0, trainer.global_step - self._step0
        times = f"elapsed {clock(elapsed)}"
        if trainer.max_steps > 0 and done > 0:
            times += f"  ETA {clock(elapsed / done * max(0, trainer.max_steps - trainer.global_step))}"
        return times

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        super().on_validation_start(trainer, pl_module)
        self._before_eval = dict(trainer.progress_bar_metrics)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        """This pass's values, once: ``step N  val/loss 4.7970  ...`` (each pass publishes new ones)."""
        super().on_validation_end(trainer, pl_module)
        if trainer.sanity_checking:
            return
        new = {k: v for k, v in trainer.progress_bar_metrics.items() if self._before_eval.get(k) is not v}
        self._eval_keys |= set(new)
        if trainer.is_global_zero and new:
            values = "  ".join(f"{k} {float(v):.4f}" for k, v in new.items())
            print(f"step {trainer.global_step}  {values}", flush=True)

    def _stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._stop()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._stop()


class GreedySamples(Callback):
    """`tokenizer`: anything with ``encode`` / ``decode`` (a Hugging Face tokenizer)."""

    def __init__(
        self, tokenizer: Any, prompt: str = "def main(", max_new_tokens: int = 48, key: str = "samples"
    ) -> None:
        self.tokenizer, self.prompt, self.max_new_tokens, self.key = tokenizer, prompt, max_new_tokens, key
        self.texts: list[tuple[int, str]] = []  # (step, text) of every sample so far

    @torch.no_grad()
    def sample(self, trainer: Any, pl_module: Any) -> str:
        strategy, model = trainer.strategy, pl_module.model
        ids = torch.tensor([self.tokenizer.encode(self.prompt)], device=strategy.root_device)
        multiple = strategy.parallel.sequence_multiple  # sp / cp split T over ranks: pad on the right
        for _ in range(self.max_new_tokens):
            n = ids.shape[1]
            padded = torch.nn.functional.pad(ids, (0, -n % multiple))  # causal: padding never seen at < n
            batch = strategy.shard_batch({"input_ids": padded})  # cp: this rank's share of the tokens
            with strategy.autocast():
                # (1, T, V): the last stage's; a placeholder on the others
                logits = model(batch["input_ids"], position_ids=batch.get("position_ids"))
            local = batch["input_ids"].shape[1]
            best = logits[0].argmax(-1) if logits.dim() == 3 else torch.zeros(local, dtype=torch.long)
            last = strategy.gather_sequence(best.to(padded.device)[None])[0, n - 1]
            token = strategy.reduce(last.float()).round().long().reshape(1, 1)  # the last stage's, everywhere
            ids = torch.cat([ids, token.to(ids.device)], dim=1)
        return self.tokenizer.decode(ids[0].tolist())

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.sanity_checking:
            return
        was_training = pl_module.training
        pl_module.eval()
        text = self.sample(trainer, pl_module)
        pl_module.train(was_training)
        self.texts.append((trainer.global_step, text))
        if trainer.is_global_zero:
            print(f"step {trainer.global_step} sample: {text!r}", flush=True)
            for logger in trainer.loggers:
                logger.log_text(self.key, text, trainer.global_step)
