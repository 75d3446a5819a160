"""`GreedySamples`: after each validation, the model's greedy continuation of a fixed prompt.

Numbers say a run learns; a sample shows what it learned ("the the the" after 200 steps is a
different run from one that writes plausible code). Works at every layout: each step runs the
whole model (under pipeline parallelism each stage forwards its part), and the next token is
taken from the last stage through `Strategy.reduce`, so every rank continues the same text.
Printed on rank 0 and sent to the loggers (``Logger.log_text``: a W&B table).
"""

from __future__ import annotations

from typing import Any

import torch

from nanolight.callbacks.base import Callback


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
        multiple = strategy.sequence_multiple  # sequence parallelism splits T over tp: pad on the right
        for _ in range(self.max_new_tokens):
            n = ids.shape[1]
            padded = torch.nn.functional.pad(ids, (0, -n % multiple))  # causal: padding never seen at < n
            with strategy.autocast():
                logits = model(padded)  # (1, T, V): the last stage's; a placeholder on the others
            last = logits[0, n - 1].argmax() if logits.dim() == 3 else torch.zeros((), dtype=torch.long)
            token = strategy.reduce(last.float()).round().long().reshape(1, 1)  # the last stage's, everywhere
            ids = torch.cat([ids, token.to(ids.device)], dim=1)
        return self.tokenizer.decode(ids[0].tolist())

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if getattr(trainer, "sanity_checking", False):
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
