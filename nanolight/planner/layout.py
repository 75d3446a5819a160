"""`Layout`: one way to run a model on a cluster, as the planner enumerates and ranks it.

The fields are the recipe's own knobs (`+parallel.*`, `trainer.*`), so a row the planner prints
is a command line. `is_valid` asks the code that would run the layout -- `ParallelConfig`, the
pipeline split, the schedules' micro-batch rule -- so a layout the trainer refuses is never
listed. `cp` (context parallelism: each sequence split over a ring of cp ranks, ring attention)
is checked by its own rule -- the sequence cut into 2*cp equal chunks (`ring_attention.zigzag_shard`)
-- until `ParallelConfig` accepts cp > 1 (issue 21); the rest by `ParallelConfig` at cp = 1.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from nanolight.errors import UsageError
from nanolight.models.llama_config import LlamaConfig
from nanolight.parallel.blocks import MODES
from nanolight.parallel.config import ParallelConfig
from nanolight.parallel.pipeline.schedules import check_micro_batches
from nanolight.parallel.pipeline.split import check_pipeline_layout
from nanolight.precision import Precision

# precision -> (parameter bytes, gradient bytes, activation bytes, residual-stream bytes)
# 32-true: everything fp32. bf16-mixed: fp32 parameters and gradients, autocast computes in bf16
# (matmul inputs/outputs bf16; the residual stream and norms stay fp32). bf16-master: bf16
# weights and activations, fp32 gradient accumulation, fp32 master weights in the optimizer.
# bf16-true: everything bf16 (no master copy outside ZeRO-1).
PRECISION_BYTES = {
    "32-true": (4, 4, 4, 4),
    "bf16-mixed": (4, 4, 2, 4),
    "bf16-master": (2, 4, 2, 2),
    "bf16-true": (2, 2, 2, 2),
}


@dataclass(frozen=True)
class Layout:
    """Parallel degrees, schedule, recompute and batch split of one training run."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1  # context parallelism: ranks splitting each sequence (ring attention)
    pp_schedule: str = "1f1b"
    pp_virtual: int = 1
    zero_stage: int = 0
    sequence_parallel: bool = False
    activation_checkpointing: str = "none"
    micro_batch_size: int = 1
    accumulate_grad_batches: int = 1
    precision: str = "bf16-mixed"

    def __post_init__(self) -> None:
        if self.precision not in PRECISION_BYTES:
            raise UsageError(f"precision={self.precision!r} is not one of {list(PRECISION_BYTES)}")
        if self.activation_checkpointing not in MODES:
            raise UsageError(
                f"activation_checkpointing={self.activation_checkpointing!r} is not one of {MODES}"
            )
        if isinstance(self.cp, bool) or not isinstance(self.cp, int) or self.cp < 1:
            raise UsageError(f"cp={self.cp!r} must be a positive integer")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def replicas(self) -> int:
        """Ranks holding the same weights (dp x cp): gradients reduce and ZeRO-1 shards over them."""
        return self.dp * self.cp

    @property
    def sequences_per_step(self) -> int:
        """Sequences in one optimizer step's global batch (cp ranks share theirs)."""
        return self.micro_batch_size * self.accumulate_grad_batches * self.dp

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(
            tp=self.tp,
            pp=self.pp,
            dp=self.dp,
            cp=self.cp,
            zero_stage=self.zero_stage,
            pp_schedule=self.pp_schedule,
            sequence_parallel=self.sequence_parallel,
            pp_virtual=self.pp_virtual,
        )

    def check(self, config: LlamaConfig, seq_len: int) -> None:
        """Raise the trainer's own error if it would refuse this layout for this model."""
        parallel = self.parallel_config()
        parallel.check_model(config.num_attention_heads, config.num_key_value_heads, config.vocab_size)
        if self.pp > 1:
            check_pipeline_layout(self.pp, config.num_hidden_layers, self.pp_virtual)
            check_micro_batches(self.pp, self.pp_schedule, self.accumulate_grad_batches)
        Precision(self.precision).check_layout(self.zero_stage, self.replicas)  # the strategy's own rule
        if self.sequence_parallel and self.tp == 1:
            raise UsageError("sequence_parallel splits a rank's tokens over tp: it needs tp > 1")
        parallel.check_sequence(seq_len)  # cp's 2*cp chunks, sequence parallelism's T/cp over tp

    def is_valid(self, config: LlamaConfig, seq_len: int) -> bool:
        try:
            self.check(config, seq_len)
        except (UsageError, ValueError):
            return False
        return True

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def overrides(self) -> str:
        """The recipe's command-line overrides that run this layout."""
        parts = [f"+parallel.tp={self.tp}", f"+parallel.pp={self.pp}", f"+parallel.dp={self.dp}"]
        if self.cp > 1:
            parts.append(f"+parallel.cp={self.cp}")
        if self.pp > 1:
            parts.append(f"+parallel.pp_schedule={self.pp_schedule}")
        if self.pp_virtual > 1:
            parts.append(f"+parallel.pp_virtual={self.pp_virtual}")
        if self.zero_stage:
            parts.append(f"+parallel.zero_stage={self.zero_stage}")
        if self.sequence_parallel:
            parts.append("+parallel.sequence_parallel=true")
        parts += [
            f"trainer.activation_checkpointing={self.activation_checkpointing}",
            f"trainer.micro_batch_size={self.micro_batch_size}",
            f"trainer.accumulate_grad_batches={self.accumulate_grad_batches}",
            f"trainer.precision={self.precision}",
        ]
        return " ".join(parts)
