"""The pretraining recipe's config schema: one dataclass per section of `conf/config.yaml`.

Sections that configure a library component reuse that component's own dataclass
(`LlamaConfig`, `DataConfig`, `ParallelConfig`); the rest (trainer loop knobs, optimizer,
checkpointing, loggers) are recipe-level and live here. `load_config` is the single entry point:
composed Hydra tree in, validated `PretrainConfig` out, or a `ConfigError` naming the key.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from omegaconf import DictConfig, OmegaConf

from nanolight.data.config import DataConfig
from nanolight.models.llama import LlamaConfig
from nanolight.parallel.config import ParallelConfig
from nanolight.pretrain.schema import ConfigError, build_dataclass

Precision = Literal["auto", "32-true", "bf16-mixed", "bf16-true", "bf16-master"]
Recompute = Literal["none", "full", "selective"]


@dataclass
class TrainConfig:
    """Loop sizes. The global batch is micro_batch_size * accumulate_grad_batches * dp.

    Speed (`parallel/blocks.py`): `activation_checkpointing` recomputes
    "full" decoder blocks or their "selective" cheap ops in backward, on every
    `activation_checkpointing_every`-th block; `compile` runs each decoder block under torch.compile."""

    max_steps: int = 320
    max_epochs: int | None = None
    micro_batch_size: int = 16
    seq_len: int = 256
    accumulate_grad_batches: int = 1
    precision: Precision = "auto"  # `run_precision`
    gradient_clip_val: float | None = 1.0
    default_root_dir: str = "runs/smollm"
    log_every_n_steps: int = 10
    val_check_interval: int | None = 80
    limit_val_batches: int = 8
    enable_progress_bar: bool = True
    deterministic: bool = False
    activation_checkpointing: Recompute = "none"
    activation_checkpointing_every: int = 1
    compile: bool = False
    stop_on_divergence: bool = True  # `DivergenceCheck`: a non-finite loss/grad norm ends the run, unsaved

    @property
    def run_precision(self) -> str:
        """``auto``: ``bf16-master`` on a GPU (bf16 compute, fp32 masters: nanolight/precision.py),
        ``32-true`` on CPU (where bf16 is slow and tests keep their fp32 numbers)."""
        if self.precision != "auto":
            return self.precision
        return "bf16-master" if torch.cuda.is_available() else "32-true"

    def __post_init__(self) -> None:
        for name in (
            "max_steps",
            "micro_batch_size",
            "seq_len",
            "accumulate_grad_batches",
            "log_every_n_steps",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.{name} must be >= 1, got {getattr(self, name)}")
        if self.activation_checkpointing_every < 1:
            raise ValueError(
                f"trainer.activation_checkpointing_every must be >= 1 (1: every decoder block, 2: every 2nd, "
                f"...), got {self.activation_checkpointing_every}"
            )
        if self.activation_checkpointing == "none" and self.activation_checkpointing_every != 1:
            raise ValueError(
                "trainer.activation_checkpointing_every is set but trainer.activation_checkpointing=none; "
                "add trainer.activation_checkpointing=full (or selective)"
            )
        if self.val_check_interval is not None and self.val_check_interval < 1:
            raise ValueError("trainer.val_check_interval must be >= 1 (optimizer steps) or null to disable")


@dataclass
class OptimConfig:
    """AdamW with linear warm-up then cosine decay to `min_lr_ratio * lr` (the SmolLM recipe)."""

    lr: float = 4e-3
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        if not 0 < self.lr < math.inf:  # nan compares false both ways: it would reach torch's AdamW
            raise ValueError(f"optim.lr must be a finite number > 0, got {self.lr}")
        if not (math.isfinite(self.weight_decay) and math.isfinite(self.eps) and self.eps >= 0):
            raise ValueError(
                f"optim.weight_decay and optim.eps must be finite (eps >= 0), got {self.weight_decay}, {self.eps}"
            )
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optim.betas must be two numbers in [0, 1), got {self.betas}")
        if self.warmup_steps < 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("optim.warmup_steps must be >= 0 and optim.min_lr_ratio in [0, 1]")


@dataclass
class CheckpointConfig:
    """`resume`: null (fresh run), `last` (newest in the run directory) or a checkpoint path.
    `init_from`: a nanolight model directory (e.g. from scripts/convert_hf_to_nanolight.py)
    whose weights initialise the model of a fresh run."""

    every_n_steps: int | None = 100
    keep_last_n: int | None = 3
    save_last: bool = True
    resume: str | None = None
    init_from: str | None = None

    def __post_init__(self) -> None:
        if self.every_n_steps is not None and self.every_n_steps < 1:
            raise ValueError("checkpoint.every_n_steps must be >= 1 or null")
        if self.keep_last_n is not None and self.keep_last_n < 1:
            raise ValueError("checkpoint.keep_last_n must be >= 1 or null (keep all)")


@dataclass
class LoggerConfig:
    """CSV always writes `metrics.csv`; wandb is online when logged in, offline otherwise."""

    csv: bool = True
    wandb: bool = True
    project: str = "nanolight"
    name: str | None = None
    offline: bool | None = None
    log_model: bool = False


@dataclass
class ClusterConfig:
    """What `+parallel=auto` plans for (`pretrain/auto.py`) and `+dry_run=true` plays: `gpus` ranks under plain python (default:
    the visible GPUs, 1 on CPU; torchrun/srun's world otherwise) of the `gpu` model from the planner's
    table (default: the visible GPU's, `cpu` measured on a machine without one)."""

    gpus: int | None = None
    gpu: str | None = None

    def __post_init__(self) -> None:
        if self.gpus is not None and self.gpus < 1:
            raise ValueError(f"cluster.gpus must be >= 1, got {self.gpus}")


@dataclass
class PretrainConfig:
    seed: int = 42
    model: LlamaConfig = field(default_factory=lambda: LlamaConfig.preset("smollm-tiny"))
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    dry_run: bool = (
        False  # `+dry_run=true`: every role's real program under fake tensors (`pretrain/dry_run.py`)
    )
    # `+parallel=auto`: the planner replaces `parallel` and the trainer's batch split before the run
    auto_parallel: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if self.trainer.seq_len > self.model.max_position_embeddings:
            raise ConfigError(
                f"trainer.seq_len={self.trainer.seq_len} is above the model's maximum "
                f"(model.max_position_embeddings={self.model.max_position_embeddings}); "
                f"lower trainer.seq_len or pick a model preset with longer context"
            )


AUTO_FORMS = ("parallel=auto", "+parallel=auto", "++parallel=auto")


def load_config(cfg: DictConfig | dict[str, Any], overrides: list[str] | None = None) -> PretrainConfig:
    """Validate a composed config. Raises ConfigError naming the first bad key. `overrides`: the
    command line, which says `+parallel=auto` even where Hydra replaced it by pinned keys
    (``+parallel=auto +parallel.tp=2`` composes to ``parallel: {tp: 2}``)."""
    raw = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    raw.pop("hydra", None)
    parallel = raw.get("parallel")
    auto = parallel == "auto" or any(o in AUTO_FORMS for o in overrides or ())
    if auto and not isinstance(parallel, dict):
        raw.pop("parallel", None)  # the planner fills it; pinned keys (a mapping) stay, validated
    elif isinstance(parallel, str):
        keys = ", ".join(f.name for f in dataclasses.fields(ParallelConfig) if f.init)
        raise ConfigError(
            f"+parallel={parallel} is not a layout: write +parallel=auto (the planner picks one) or set its "
            f"keys, e.g. +parallel.tp=2 +parallel.dp=2 (keys: {keys})"
        )
    elif raw.get("cluster") and not auto and not raw.get("dry_run"):
        raise ConfigError("+cluster.* is read by +parallel=auto and +dry_run=true only; add one or drop it")
    config = build_dataclass(PretrainConfig, raw, "")
    config.auto_parallel = auto
    return config


def to_dict(config: PretrainConfig) -> dict[str, Any]:
    """The resolved config as plain data, for `config.yaml` and the loggers' hyperparameters."""
    return dataclasses.asdict(config)
