"""`Parallel3DStrategy`: tensor, pipeline and data parallelism (with ZeRO-1) over tp x pp x dp
processes, whose groups the `ParallelContext` holds.

What it does, in `NanoTrainer.fit` order:

1. `setup_environment`: make the processes (torchrun / SLURM / re-launch under plain python,
   see `launcher.py`), join the world, build the `ParallelContext`.
2. `configure_model` runs on the meta device (`init_device`), so no rank ever holds the full
   model; `setup_module` applies the model's `tp_plan`, with pp > 1 cuts the model into stages
   and drops the other stages' modules (`pipeline_support.py`, `parallel/pipeline/split.py`),
   materialises the shards on this rank's device and initialises them topology-independently
   (or slices a pretrained checkpoint).
3. Each step: the base micro-batch loop, or with pp > 1 the pipeline engine (1F1B or
   all-forward-all-backward, `parallel/pipeline/engine.py`) that calls the trainer's
   micro_step on every stage in schedule order; `reduce` takes logged metrics from the last
   stage, which owns the loss. With sequence parallelism the replicated (norm)
   gradients are then summed over tp; clipping uses the global norm over tp with replicated
   parameters counted once. Data parallelism (`parallel/data_parallel.py`): `setup_optimizers`
   buckets the gradients, which are reduced over dp from backward hooks during the last
   micro-batch's backward and waited for at the end of `training_step`; with zero_stage=1 the
   optimizer becomes a `ZeroOptimizer` (`parallel/zero.py`) that holds 1/dp of the optimizer
   state and fp32 master weights, and the norm is taken over its gradient shards.
4. Checkpoints are per-rank shards plus one index (`sharded_checkpoint.py`): every rank writes
   the slices it owns (its tp slice of its stage's weights, its ZeRO-1 partition of the
   optimizer state, its RNG and data position), so saving never gathers a model on one rank,
   and any topology (or one device) loads them by reading just the blocks it holds. The
   gathered single-device view (`full_state.py`) loads `SingleDeviceStrategy` checkpoints.
"""

from __future__ import annotations

import atexit
import dataclasses
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nanolight.checkpoint.pretrained import step_dir_meta
from nanolight.checkpoint.sharded import is_sharded_checkpoint
from nanolight.parallel import ParallelConfig, ParallelContext
from nanolight.parallel.data_parallel import DEFAULT_BUCKET_BYTES, DataParallel
from nanolight.parallel.grad_norm import clip_grads_, grad_norm, owned_for_norm
from nanolight.parallel.init import init_sharded_
from nanolight.parallel.tensor_parallel.apply import (
    apply_tensor_parallel,
    grad_norm_squared,
    shard_dims,
    sync_replicated_grads,
    take_shard,
)
from nanolight.precision import Precision
from nanolight.strategies.base import Strategy
from nanolight.strategies.full_state import GatheredStateMixin
from nanolight.strategies.launcher import detect_environment, ensure_processes, init_distributed
from nanolight.strategies.pipeline_support import PipelineSetup
from nanolight.strategies.sharded_checkpoint import ShardedCheckpointer, tied_aliases


class Parallel3DStrategy(GatheredStateMixin, Strategy):
    """Train a module whose model declares a `tp_plan` over tp (x pp x dp) processes.

    `init_seed` seeds the topology-independent init (default: `torch.initial_seed()`, i.e. the
    trainer's `seed`); `pretrained` is a nanolight checkpoint directory to start from instead.
    """

    def __init__(
        self,
        tp: int = 1,
        pp: int = 1,
        dp: int | str = 1,
        zero_stage: int = 0,
        pp_schedule: str = "1f1b",
        sequence_parallel: bool = False,
        precision: str | Precision = "32-true",
        *,
        init_seed: int | None = None,
        pretrained: str | Path | None = None,
        backend: str | None = None,
        timeout: timedelta = timedelta(minutes=10),
        pp_layers_per_stage: list[int] | None = None,
        dp_bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        super().__init__(precision)
        self.config = ParallelConfig(tp, pp, dp, zero_stage, pp_schedule, sequence_parallel)
        self.init_seed, self.pretrained = init_seed, pretrained
        self.backend, self.timeout = backend, timeout
        self._ctx: ParallelContext | None = None
        self.pp_layers_per_stage = pp_layers_per_stage  # None: balanced by cost (pipeline/split.py)
        self._pipeline: PipelineSetup | None = None  # pp > 1: this rank's stage and engine
        self.dp_bucket_bytes = dp_bucket_bytes  # gradient bucket size of the dp reduction
        self._dp: DataParallel | None = None  # dp > 1 or ZeRO: gradient reduction (data_parallel.py)
        self._checkpointer: ShardedCheckpointer | None = None  # built by setup_module

    @classmethod
    def from_config(cls, config: ParallelConfig, **kwargs: Any) -> Parallel3DStrategy:
        """Build from the Hydra `parallel` group (`+parallel.tp=2 ...`)."""
        return cls(**dataclasses.asdict(config), **kwargs)

    # ---- topology ------------------------------------------------------------------------
    @property
    def parallel_context(self) -> ParallelContext | None:
        return self._ctx

    @property
    def root_device(self) -> torch.device:
        if self._ctx is not None:
            return self._ctx.device
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )

    @property
    def world_size(self) -> int:
        return self._ctx.world_size if self._ctx is not None else 1

    @property
    def global_rank(self) -> int:
        return self._ctx.global_rank if self._ctx is not None else 0

    @property
    def data_parallel_size(self) -> int:
        return self._ctx.dp_size if self._ctx is not None else 1

    def _tp_group(self) -> Any:
        assert self._ctx is not None, "setup_environment() has not run"
        return self._ctx.tp_group

    # ---- lifecycle -----------------------------------------------------------------------
    def setup_environment(self) -> None:
        if self._ctx is None:
            cfg = self.config
            env = detect_environment()
            # under plain python, dp="auto" means one replica: the world is what tp*pp need
            world = (
                env.world_size if env is not None else cfg.tp * cfg.pp * (1 if cfg.dp == "auto" else cfg.dp)
            )
            dp = cfg.resolve_dp(world)  # world must be tp*pp*dp: a clear error, before anything starts
            env = ensure_processes(world)  # plain python, world > 1: re-launches and never returns
            init_distributed(env, self.backend, self.timeout)
            self._ctx = ParallelContext(cfg.tp, cfg.pp, dp, timeout=self.timeout)
            atexit.register(self._ctx.destroy)
        super().setup_environment()

    def init_device(self) -> torch.device | None:
        return torch.device("meta")  # the full model is never materialised on one rank

    def setup_module(self, module: nn.Module) -> nn.Module:
        model = _find_tp_model(module)
        cfg = getattr(model, "config", None)
        if cfg is not None:
            self.config.check_model(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size)
        # the unsharded, unsplit model's names/shapes: what a checkpoint's global tensors must match
        full_shapes = {k: tuple(v.shape) for k, v in module.state_dict().items()}
        aliases = tied_aliases(module)
        on_meta = any(p.is_meta for p in module.parameters())
        pipe = None
        if self.config.pp > 1:
            pipe = PipelineSetup(self._ctx, self.config.pp_schedule, self.pp_layers_per_stage)
            pipe.record_full_model(module, model)  # names/shapes of the unsplit model (meta: free)
        self._pipeline = pipe
        apply_tensor_parallel(model, model.tp_plan, self._tp_group(), self.config.sequence_parallel)
        if pipe is not None:
            pipe.split(model)  # drop other stages' modules before anything is allocated
        if on_meta:
            module.to_empty(device=self.root_device)
            if pipe is not None:
                pipe.retie()  # to_empty made new Parameter objects
            elif hasattr(model, "tie_weights"):
                model.tie_weights()  # to_empty made new Parameter objects
            if self.pretrained is not None:
                self._load_pretrained(model)
            else:
                # rank 0's seed for all: without a trainer seed each process's initial seed differs
                seed = self.broadcast(self.init_seed if self.init_seed is not None else torch.initial_seed())
                if pipe is not None:  # replays the *unsplit* init stream (see split.py)
                    pipe.init_weights(seed, self._tp_group())
                else:
                    init_sharded_(model, torch.Generator().manual_seed(seed), self._tp_group())
        else:  # built materialised: apply_tensor_parallel already copied each rank's slice
            module.to(self.root_device)
        self.precision.convert_module(module)
        if self._pipeline is not None:
            self._pipeline.build_engine()
        self.module = module
        self._checkpointer = ShardedCheckpointer(
            self._ctx,
            module,
            full_shapes,
            aliases,
            self._topology(),
            step_dir_meta(module, self.pretrained),
        )
        return module

    def _topology(self) -> dict[str, Any]:
        ctx = self._ctx
        return {
            "tp": ctx.tp_size, "pp": ctx.pp_size, "dp": ctx.dp_size, "world_size": ctx.world_size,
            "zero_stage": self.config.zero_stage, "sequence_parallel": self.config.sequence_parallel,
        }  # fmt: skip

    def _load_pretrained(self, model: nn.Module) -> None:
        from nanolight.checkpoint.pretrained import read_checkpoint

        _, state, _ = read_checkpoint(self.pretrained)
        dims = shard_dims(model)  # tied lm_head appears once, as in the file
        missing = sorted(set(dims) - set(state))
        if missing:
            raise ValueError(f"pretrained checkpoint {self.pretrained} lacks {missing[:8]}")
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(take_shard(state[name], dims[name], self._tp_group()))

    def setup_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> list[Any]:
        """Data parallelism: bucketed gradient reduction, or ZeRO-1 around the optimizer."""
        assert self.module is not None and self._ctx is not None
        self._dp = DataParallel(self._ctx, self.config.zero_stage, self.dp_bucket_bytes)
        self.optimizers = self._dp.setup_optimizers(self.module, list(optimizers), self._presum())
        return self.optimizers

    def _presum(self) -> list[tuple[set[int], Any]]:
        """Gradients the dp reducer must first sum over another group (see `GradReducer`)."""
        out = []
        if self.config.sequence_parallel and self.config.tp > 1:  # norm weights saw T/tp tokens
            dims = shard_dims(self.module)
            norms = {id(p) for name, p in self.module.named_parameters() if dims[name] is None}
            out.append((norms, self._tp_group()))
        engine = self._pipeline.engine if self._pipeline is not None else None
        if engine is not None and engine.tie_group is not None and engine.tied_weight() is not None:
            out.append(({id(engine.tied_weight())}, engine.tie_group))  # first + last stage copies
        return out

    # ---- one optimizer step --------------------------------------------------------------
    def training_step(self, micro_batches: Any, micro_step: Any) -> torch.Tensor:
        dp = self._dp if self._dp is not None and self._dp.active else None
        if dp is not None:  # reduce gradients in the last micro-batch's backward only
            micro_step = dp.wrap(micro_step, len(micro_batches))
        if self._pipeline is not None:  # the pipeline schedule calls micro_step on every stage
            loss = self._pipeline.engine.run(micro_batches, micro_step)
        else:
            loss = super().training_step(micro_batches, micro_step)
        if dp is not None:
            dp.finish()  # waits for the bucket collectives; did the SP / tied-embedding sums too
            return dp.mean_loss(loss)  # every rank sees the same step loss (NaN checks agree)
        if self.config.sequence_parallel:
            sync_replicated_grads(self.module, self._tp_group())
        if self._pipeline is not None:
            self._pipeline.engine.sum_tied_grads()  # after every reduction that writes param.grad
        return loss

    def zero_grad(self, optimizer: Any) -> None:
        if self._dp is not None:
            self._dp.zero_grad(optimizer)  # keeps .grad as views of the dp gradient buckets
        else:
            super().zero_grad(optimizer)

    def clip_gradients(self, max_norm: float | None) -> torch.Tensor:
        """Global L2 norm over the tp group (shards summed, replicated params once), then clip."""
        assert self.module is not None
        if self._dp is not None and self._dp.zero is not None:  # gradients are 1/dp shards
            return self._clip_zero_gradients(max_norm)
        if self._pipeline is not None:  # summed over pp too, tied embedding counted once
            norm = self._pipeline.grad_norm_squared(self.module, self._tp_group()).sqrt()
        else:
            norm = grad_norm_squared(self.module, self._tp_group()).sqrt()
        if max_norm is not None:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # as torch's clip_grad_norm_
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)
        return norm

    def _clip_zero_gradients(self, max_norm: float | None) -> torch.Tensor:
        """ZeRO-1: the norm of the gradient shards, summed over dp, tp and pp (grad_norm.py)."""
        ctx, zero, excluded = self._ctx, self._dp.zero, set()
        pipe = self._pipeline
        if pipe is not None and pipe.tied and ctx.is_last_stage and pipe.lm.model.embed_tokens is not None:
            excluded.add(id(pipe.lm.model.embed_tokens.weight))  # the first stage counts the tied copy
        owned = owned_for_norm(self.module, ctx.tp_rank, excluded)
        pp_group = ctx.pp_group if pipe is not None else None
        norm = grad_norm(self.module, owned, ctx.tp_group, pp_group, ctx.dp_group, zero)
        if max_norm is not None:
            clip_grads_(self.module, norm, max_norm, zero)
        return norm

    # ---- collectives ---------------------------------------------------------------------
    def reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        if self._pipeline is not None:  # only the last stage computed the loss: take its value
            tensor = self._pipeline.from_last_stage(tensor)
        if self._ctx is None or self._ctx.dp_size == 1:
            return tensor  # tp ranks already hold identical metrics
        out = tensor.detach().clone().to(self.root_device)
        dist.all_reduce(out, group=self._ctx.dp_group)  # dp replicas sum their metric
        return out / self._ctx.dp_size if op == "mean" else out

    def barrier(self, name: str | None = None) -> None:
        if self._ctx is not None:
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self._ctx is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)  # rank `src` sends obj to every rank
        return box[0]

    def any_rank(self, flag: bool) -> bool:
        if self._ctx is None or self._ctx.world_size == 1:
            return flag  # one process: no collective (the trainer asks this every step)
        box = torch.tensor([int(flag)], dtype=torch.int32, device=self.root_device)
        dist.all_reduce(box, op=dist.ReduceOp.MAX)  # every rank sends its 0/1 flag, all get the max
        return bool(box.item())

    # ---- checkpoints: per-rank shards + index (sharded_checkpoint.py) ------------------------
    def save_checkpoint(self, path: str | Path, state: dict[str, Any]) -> None:
        """Every rank writes what it owns; rank 0 the index; published atomically (collective)."""
        self._checkpointer.save(Path(path), self.optimizers, state)

    def load_checkpoint(self, path: str | Path, load_optimizer: bool = True) -> dict[str, Any]:
        """A sharded checkpoint from any topology (or a single-device one): this rank's slices."""
        if not is_sharded_checkpoint(path):
            return super().load_checkpoint(path, load_optimizer)
        state = self._checkpointer.load_model(Path(path))
        if self._dp is not None:
            self._dp.reload_master_weights()  # ZeRO-1's fp32 master shards follow the new weights
        if load_optimizer:
            self.load_optimizer_checkpoint(path)
        return state

    def load_optimizer_checkpoint(self, path: str | Path) -> None:
        if not is_sharded_checkpoint(path):
            return super().load_optimizer_checkpoint(path)
        self._checkpointer.load_optimizers(Path(path), self.optimizers)


def _find_tp_model(module: nn.Module) -> nn.Module:
    """The (first) submodule that declares a tensor-parallel plan, e.g. `LlamaForCausalLM`."""
    for sub in module.modules():
        if isinstance(getattr(sub, "tp_plan", None), dict):
            return sub
    raise TypeError(
        f"Parallel3DStrategy found no model with a `tp_plan` inside {type(module).__name__}; build one "
        "(e.g. nanolight.models.LlamaForCausalLM) in configure_model()"
    )
