"""`CausalLMPretrain`: the NanoModule the SmolLM recipe trains, usable from any script.

It is deliberately the module a user would write: the model computes its own loss from the
data's already-shifted `target_ids`, so `training_step` stays two lines at every parallel layout
(the strategy swaps the loss for the vocab-parallel one under tensor parallelism, and makes it
the exact token mean of the step: `parallel/loss_tokens.py`). A batch with HF-style `labels`
(aligned with input_ids) works too: the model shifts them.
"""

from __future__ import annotations

import gzip
import lzma
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nanolight.checkpoint.load import load_model
from nanolight.checkpoint.reader import CheckpointReader, stored_model_prefix
from nanolight.models.llama import LlamaConfig, LlamaForCausalLM
from nanolight.models.llama_config import flops_per_token
from nanolight.module import NanoModule
from nanolight.parallel.layout import ModelLayout
from nanolight.pretrain.config import OptimConfig


def warmup_cosine(warmup_steps: int, total_steps: int, min_lr_ratio: float):
    """LR multiplier: linear warm-up from ~0 to 1, then cosine decay to `min_lr_ratio`."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: norms (1-D) are left undecayed, as in GPT-2/Llama recipes."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def adamw_kernel(device: torch.device) -> dict[str, bool]:
    """One kernel launch per step instead of one per tensor: the fused AdamW on CUDA, the
    multi-tensor (foreach) one elsewhere. ZeRO-1 steps its flat shards with the same kernel."""
    return {"fused": True} if device.type == "cuda" else {"foreach": True}


def load_weights(model: LlamaForCausalLM, path: str) -> None:
    """Copy a nanolight model directory's weights into `model`; another model is an error naming
    the tensors (the same check a resume makes)."""
    reader = CheckpointReader.open(path)
    load_model(reader, model, ModelLayout.whole(model), stored_prefix=stored_model_prefix(path))


class CausalLMPretrain(NanoModule):
    """Next-token pretraining of a Llama-architecture model."""

    def __init__(
        self,
        model_config: LlamaConfig,
        optim: OptimConfig,
        seq_len: int,
        max_steps: int,
        init_from: str | None = None,
        bytes_per_token: float | None = None,
        kernels: str | None = None,
    ) -> None:
        """`bytes_per_token` (of the held-out text) turns the validation loss into
        ``val/bits_per_byte``, comparable across tokenizers and with a compressor's. (What the
        checkpoints carry for a complete export is the strategy's: `run.py` hands it over.)
        `kernels`: the device type whose optimizer kernel to pick when it is not the parameters'
        (the dry run plays a CUDA rank on this CPU, so it steps with CUDA's fused AdamW)."""
        super().__init__()
        self.kernels = kernels
        self.init_from = init_from
        self.bytes_per_token = bytes_per_token
        self.model_config = model_config
        self.optim = optim
        self.seq_len = seq_len
        self.max_steps = max_steps
        self.model: LlamaForCausalLM | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        self.model = LlamaForCausalLM(self.model_config)  # on meta when the strategy shards it
        if any(p.is_meta for p in self.model.parameters()):
            return  # the strategy materialises, initialises or loads each shard
        if self.init_from is not None:
            load_weights(self.model, self.init_from)
        else:
            # The same generator-driven init the sharded strategies replay per parameter, seeded from
            # the trainer's seed, so every layout starts from the same weights.
            self.model.init_weights(torch.Generator().manual_seed(torch.initial_seed()))

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The token loss (in a training step, this micro-batch's share of the step's token mean);
        `data.document_mask` adds each token's position and document."""
        key = "target_ids" if "target_ids" in batch else "labels"  # the data's, or HF-style labels
        targets = {key: batch[key]}
        return self.model(
            batch["input_ids"],
            position_ids=batch.get("position_ids"),
            document_ids=batch.get("document_ids"),
            cu_seqlens=batch.get("cu_seqlens"),
            max_seqlen=batch.get("max_seqlen"),
            **targets,
        )

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # train/loss is the global batch's mean (every micro-batch, every dp rank, from the last
        # pipeline stage), not Lightning's default of the last micro-batch's value
        self.log("train/loss", self.trainer.step_loss, prog_bar=True)

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        norm = self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        if norm is not None:  # the pre-clip global norm, summed over every parallel rank
            self.log("grad_norm", norm)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self(batch)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        if self.bytes_per_token:  # nats/token -> bits/byte (a mean of per-batch values: linear)
            self.log(
                "val/bits_per_byte", loss / math.log(2) / self.bytes_per_token, prog_bar=True, sync_dist=True
            )
        return loss

    def configure_optimizers(self):
        o = self.optim
        optimizer = torch.optim.AdamW(
            param_groups(self.model, o.weight_decay),
            lr=o.lr,
            betas=tuple(o.betas),
            eps=o.eps,
            **adamw_kernel(
                torch.device(self.kernels) if self.kernels else next(self.model.parameters()).device
            ),
        )
        schedule = warmup_cosine(o.warmup_steps, self.max_steps, o.min_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def flops_per_token(self) -> float:
        return flops_per_token(self.model_config, self.seq_len)


# ---- the held-out split's worth in bits per byte, beside gzip and xz -----------------------------
#
# What the held-out split is worth in bits per byte, and what a compressor does on it.
#
# Nats per token depend on the tokenizer; bits per byte of the text do not, so the validation loss
# is reported as both (``val/bits_per_byte``, from the split's bytes per token) and set next to
# ``gzip -9`` and ``xz -9`` on the very same text: a language model that cannot beat gzip has not
# learned much yet.


@dataclass(frozen=True)
class HeldOut:
    n_bytes: int
    n_tokens: int
    gzip_bpb: float
    xz_bpb: float

    @property
    def bytes_per_token(self) -> float:
        return self.n_bytes / self.n_tokens

    def bits_per_byte(self, nats_per_token: float) -> float:
        return nats_per_token / math.log(2) / self.bytes_per_token

    def summary(self) -> str:
        return (
            f"held-out split: {self.n_bytes:,} bytes, {self.n_tokens:,} tokens ({self.bytes_per_token:.2f} bytes/token); "
            f"gzip -9 {self.gzip_bpb:.3f} bits/byte, xz -9 {self.xz_bpb:.3f} bits/byte"
        )


def held_out(batches: Iterable[dict[str, Any]], tokenizer: Any) -> HeldOut | None:
    """Measure the text of the validation batches (their ``input_ids``, decoded); None if empty."""
    texts, n_tokens = [], 0
    for batch in batches:
        for row in batch["input_ids"].tolist():
            texts.append(tokenizer.decode(row))
            n_tokens += len(row)
    data = "".join(texts).encode("utf-8")
    if not data:
        return None
    bpb = lambda packed: 8 * len(packed) / len(data)  # noqa: E731
    return HeldOut(len(data), n_tokens, bpb(gzip.compress(data, 9)), bpb(lzma.compress(data, preset=9)))
