"""The tiny Llama the multi-process tests train (CPU, fp32), its data, and what they observe.

One definition instead of a copy per test file: `tiny_config` (hidden 64, eager attention, GQA,
tied embeddings unless asked), `TinyLM` (the two-line ``training_step`` a user writes; AdamW,
optionally decay param groups and a warm-up schedule), `token_loader`, `StepLosses` (the step
metrics a run logs) and `full_state` (a checkpoint of any layout read as one process holds it).
The spawn helper is `run_distributed` (``_dist.py``), re-exported here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from _dist import run_distributed
from torch.utils.data import DataLoader

from nanolight import Callback, NanoModule, NanoTrainer
from nanolight.models import LlamaConfig, LlamaForCausalLM
from nanolight.models.llama import shift_labels
from nanolight.strategies import SingleDeviceStrategy

__all__ = ["StepLosses", "TinyLM", "full_state", "run_distributed", "tiny_config", "token_loader"]


def tiny_config(
    vocab: int = 128, layers: int = 2, heads: int = 4, kv_heads: int = 2, tied: bool = True, **overrides: Any
) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64,
        tie_word_embeddings=tied, **{"attn_implementation": "eager", **overrides},
    )  # fmt: skip


class TinyLM(NanoModule):
    """`seed`: the init of a materialised (one-process) build, the stream sharded builds replay;
    `decay_groups`: weight decay 0.1 on matrices only (two param groups); `warmup`: a LambdaLR
    ramp over that many steps."""

    def __init__(
        self,
        config: LlamaConfig | None = None,
        seed: int | None = None,
        lr: float = 3e-3,
        decay_groups: bool = False,
        warmup: int | None = None,
    ) -> None:
        super().__init__()
        self.config = config or tiny_config()
        self.seed, self.lr, self.decay_groups, self.warmup = seed, lr, decay_groups, warmup
        self.model: LlamaForCausalLM | None = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = LlamaForCausalLM(self.config)
            if self.seed is not None and not next(self.model.parameters()).is_meta:
                self.model.init_weights(torch.Generator().manual_seed(self.seed))

    def loss(self, batch: dict) -> torch.Tensor:
        """HF-style labels (the model shifts them), or the data module's already-shifted target_ids."""
        if "target_ids" in batch:
            return self.model(batch["input_ids"], target_ids=batch["target_ids"])
        return self.model(batch["input_ids"], labels=batch["labels"])

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.log("val/loss", self.loss(batch), sync_dist=True)

    def configure_optimizers(self) -> Any:
        params: Any = self.parameters()
        if self.decay_groups:
            decay = [p for p in self.parameters() if p.ndim >= 2]
            rest = [p for p in self.parameters() if p.ndim < 2]
            params = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
        opt = torch.optim.AdamW(params, lr=self.lr)
        if self.warmup is None:
            return opt
        warmup = self.warmup
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def token_loader(
    n: int, seq_len: int = 16, vocab: int = 128, batch_size: int = 2, seed: int = 3, targets: bool = False
) -> DataLoader:
    """`n` random sequences as {"input_ids", "labels"} micro-batches (labels == input_ids), or with
    `targets` as the data module's {"input_ids", "target_ids"} (the next token, -100 at the end)."""
    ids = torch.randint(0, vocab, (n, seq_len), generator=torch.Generator().manual_seed(seed))
    if targets:
        return DataLoader(
            [{"input_ids": x, "target_ids": shift_labels(x)} for x in ids], batch_size=batch_size
        )
    return DataLoader([{"input_ids": x, "labels": x} for x in ids], batch_size=batch_size)


class StepLosses(Callback):
    """Each step's loss (``trainer.step_loss``: the global-batch mean, the same on every rank) and
    grad norm."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.norms: list[float] = []
        self._step = 0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._step = trainer.global_step

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._step:
            return  # a micro-batch before this step's update
        self._step = trainer.global_step
        self.losses.append(float(trainer.step_loss))
        if trainer.grad_norm is not None:
            self.norms.append(float(trainer.grad_norm))


def full_state(ckpt: Path, module: NanoModule, steps: int) -> tuple[dict[str, torch.Tensor], list[Any]]:
    """(state_dict, [optimizer.state_dict()]) of checkpoint `ckpt` saved after `steps` steps, read the
    way a user resuming on one device reads it (NanoTrainer + SingleDeviceStrategy)."""
    trainer = NanoTrainer(
        max_steps=steps, strategy=SingleDeviceStrategy("cpu"), logger=False, enable_progress_bar=False,
        enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=[], ckpt_path=str(ckpt))  # max_steps reached: no step runs
    assert trainer.global_step == steps
    return module.state_dict(), [opt.state_dict() for opt in trainer.optimizers]
