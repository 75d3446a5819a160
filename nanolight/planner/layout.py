"""`Layout`: one way to run a model on a cluster, as the planner enumerates and ranks it.

A layout is the recipe's `ParallelConfig` (`+parallel.*`: the same fields, the same per-field
checks) plus the `trainer.*` knobs that split the batch and set the modes, so a row the planner
prints is a command line. `check_layout` is the one place a layout is checked against a model and
a run -- the recipe calls it before any process starts (`pretrain/run.py`), the planner before it
lists a layout -- by the rules of the code that would run it: `ParallelConfig`'s, the pipeline
split's, the schedules' micro-batch rule, the precision's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Protocol

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


class ModelShape(Protocol):
    """What the layout rules ask of a model (a `LlamaConfig` has it)."""

    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    num_hidden_layers: int


def check_layout(
    parallel: ParallelConfig, model: ModelShape, seq_len: int, micro_batches: int, precision: str | None
) -> None:
    """Raise the trainer's own error if it would refuse `parallel` for this model and run
    (`micro_batches` per optimizer step; `precision` None: not yet known, its rule skipped; so is
    it while dp is "auto")."""
    parallel.check_model(model.num_attention_heads, model.num_key_value_heads, model.vocab_size)
    parallel.check_sequence(seq_len)  # cp's 2*cp chunks, sequence parallelism's T/cp over tp
    if precision is not None and parallel.dp != "auto":
        Precision(precision).check_layout(parallel.zero_stage, parallel.dp * parallel.cp)
    if parallel.pp > 1:  # every (virtual) stage needs a layer; 1F1B needs >= pp micro-batches per step
        check_pipeline_layout(parallel.pp, model.num_hidden_layers, parallel.pp_virtual)
        check_micro_batches(parallel.pp, parallel.pp_schedule, micro_batches)


@dataclass
class Layout(ParallelConfig):
    """Parallel degrees and schedule (`ParallelConfig`'s fields), recompute and batch split of
    one training run. Not mutated once built (the planner's rows are values)."""

    activation_checkpointing: str = "none"
    micro_batch_size: int = 1
    accumulate_grad_batches: int = 1
    precision: str = "bf16-mixed"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.precision not in PRECISION_BYTES:
            raise UsageError(f"precision={self.precision!r} is not one of {list(PRECISION_BYTES)}")
        if self.activation_checkpointing not in MODES:
            raise UsageError(
                f"activation_checkpointing={self.activation_checkpointing!r} is not one of {MODES}"
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def replicas(self) -> int:
        """Ranks holding the same weights (dp x cp): gradients reduce and ZeRO-1 shards over them."""
        return self.dp * self.cp

    @property
    def zero_shards(self) -> bool:
        """Whether ZeRO-1 shards the optimizer state: over one replica there is nothing to shard and
        the strategy steps the plain optimizer (`Parallel3DStrategy.setup_optimizers`)."""
        return self.zero_stage == 1 and self.replicas > 1

    @property
    def sequences_per_step(self) -> int:
        """Sequences in one optimizer step's global batch (cp ranks share theirs)."""
        return self.micro_batch_size * self.accumulate_grad_batches * self.dp

    def check(self, config: LlamaConfig, seq_len: int) -> None:
        """Raise the trainer's own error if it would refuse this layout for this model; the
        planner also skips sequence parallelism at tp = 1 (the same run as without it)."""
        check_layout(self, config, seq_len, self.accumulate_grad_batches, self.precision)
        if self.sequence_parallel and self.tp == 1:
            raise UsageError("sequence_parallel splits a rank's tokens over tp: it needs tp > 1")

    def is_valid(self, config: LlamaConfig, seq_len: int) -> bool:
        try:
            self.check(config, seq_len)
        except (UsageError, ValueError):
            return False
        return True

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "timeout_s"}  # a run's, not a layout's

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
