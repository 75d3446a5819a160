"""`Parallel3DStrategy`: tensor, pipeline, context and data parallelism (with ZeRO-1) over
tp x pp x cp x dp processes. It says *what* happens, in the documented order; the parallel core
says *how*.

1. `setup_environment`: make the processes (torchrun / SLURM / re-launch under plain python,
   `parallel/launcher.py`), join the world, build the `ParallelContext`.
2. `configure_model` runs on the meta device, so no rank ever holds the full model. `setup_module`
   then: records the full model (shapes, tied names, init order), applies the model's `tp_plan`
   (`parallel/tensor_parallel/`), cuts its `pp_plan` chunks out (`parallel/pipeline/split.py`),
   materialises this rank's shards (all three: `parallel/shard.py`) and initialises them topology-independently
   (`parallel/shard.py`) or loads them from a pretrained directory (`checkpoint/load.py`), and
   records the `ModelLayout` every later concern reads. With cp > 1 the model's attention becomes
   ring attention over the cp group (`parallel/ring_attention.py`).
3. `setup_optimizers`: `GradientSync` (`parallel/grads.py`) -- the replica (dp x cp) reduction in
   buckets or ZeRO-1 around the optimizer, the partial-gradient sums, the global norm and clipping.
4. Each step `run_step` runs the schedule (pp: the stage's program, `parallel/pipeline/`) and
   stops where the trainer's training_step or backward is due; `shard_batch` gives each cp rank
   its zigzag chunks of every sequence (every cp rank of a dp replica reads the same samples).
   `reduce` takes a metric from the last stage and averages it over dp x cp.
5. Checkpoints are per-rank shards plus one index, written and resharded by `checkpoint/`.
Collectives run under `parallel/health.py`'s watch: a silent peer is named.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nanolight.checkpoint.load import load_model
from nanolight.checkpoint.pretrained import carried_extras
from nanolight.checkpoint.reader import CheckpointReader, stored_model_prefix
from nanolight.checkpoint.save import ExportExtras
from nanolight.errors import UsageError
from nanolight.parallel import ParallelConfig, ParallelContext
from nanolight.parallel.blocks import BlockOptions, CompiledBlocks, decoder_blocks
from nanolight.parallel.data_parallel import DEFAULT_BUCKET_BYTES
from nanolight.parallel.grads import GradientSync
from nanolight.parallel.health import Heartbeat, watch, watched
from nanolight.parallel.launcher import detect_environment, ensure_processes, init_distributed
from nanolight.parallel.pipeline import PipelineStage
from nanolight.parallel.pipeline.schedules import BACKWARD, Action, check_micro_batches
from nanolight.parallel.ring_attention import RingAttention, zigzag_shard, zigzag_unshard
from nanolight.parallel.shard import (
    broadcast_replicas,
    find_plan_model,
    init_replayed_,
    replicated_layout,
    shard_model,
)
from nanolight.parallel.tensor_parallel.apply import shard_dims
from nanolight.precision import Precision
from nanolight.strategies.base import Parallelism, Strategy


class Parallel3DStrategy(Strategy):
    """Train a module whose model declares a `tp_plan` (and a `pp_plan` for pp > 1).

    `init_seed` seeds the topology-independent init (default: `torch.initial_seed()`, i.e. the
    trainer's `seed`); `pretrained` is a nanolight model directory to start from instead.
    `activation_checkpointing` / `activation_checkpointing_every` / `compile`: as for
    `SingleDeviceStrategy`, applied to this rank's blocks after tp and the pipeline split.
    `device_ids`: the CUDA device of each local rank (Lightning's ``devices=[2, 3]``); default:
    the local rank's (`parallel/launcher.py`, `cuda_device_index`). `cp`: ranks splitting each
    sequence (ring attention; the model must offer ``set_attention_backend``, as `models/`'s Llama does).
    `export`: what the run adds to each checkpoint so it exports complete (`ExportExtras`).
    """

    def __init__(
        self,
        tp: int = 1,
        pp: int = 1,
        dp: int | str = 1,
        zero_stage: int = 0,
        pp_schedule: str = "1f1b",
        sequence_parallel: bool = False,
        timeout_s: int = 600,
        precision: str | Precision = "32-true",
        *,
        init_seed: int | None = None,
        pretrained: str | Path | None = None,
        backend: str | None = None,
        pp_layers_per_stage: list[int] | None = None,
        dp_bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        activation_checkpointing: str = "none",
        activation_checkpointing_every: int = 1,
        compile: bool = False,
        pp_virtual: int = 1,
        device_ids: Sequence[int] | None = None,
        cp: int = 1,
        export: ExportExtras | None = None,
    ) -> None:
        super().__init__(precision, export)
        self.blocks = BlockOptions(activation_checkpointing, activation_checkpointing_every, compile)
        self.compiled: CompiledBlocks | None = None  # set by setup_module when compiling
        self.config = ParallelConfig(
            tp=tp,
            pp=pp,
            dp=dp,
            cp=cp,
            zero_stage=zero_stage,
            pp_schedule=pp_schedule,
            sequence_parallel=sequence_parallel,
            timeout_s=timeout_s,
            pp_virtual=pp_virtual,
        )
        self.init_seed, self.pretrained = init_seed, pretrained
        self.backend, self.timeout = backend, timedelta(seconds=timeout_s)
        self.device_ids = list(device_ids) if device_ids else None  # GPU of local rank i (devices=[2, 3])
        self.heartbeat: Heartbeat | None = None  # this rank's, and the way to tell who stopped
        self.pp_layers_per_stage = pp_layers_per_stage  # per virtual stage; None: balanced by cost
        self.dp_bucket_bytes = dp_bucket_bytes
        self._ctx: ParallelContext | None = None  # made by setup_environment
        self.stage: PipelineStage | None = None  # pp > 1: this rank's pipeline stage
        self.grads: GradientSync | None = None  # built by setup_optimizers
        self._local_rank = 0  # set by setup_environment

    @classmethod
    def from_config(cls, config: ParallelConfig, **kwargs: Any) -> Parallel3DStrategy:
        # the Hydra `parallel` group (+parallel.tp=2 ...)
        strategy = cls(**dataclasses.asdict(config), **kwargs)
        strategy.config = config  # the instance the command line built and `check_layout` checked
        return strategy

    # ---- topology ------------------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        if self._ctx is not None:
            return self._ctx.device
        cuda = torch.cuda.is_available()
        return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    @property
    def local_rank(self) -> int:
        return self._local_rank

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int] | None:
        ctx = self._ctx
        return None if ctx is None or ctx.dp_size == 1 else {"num_replicas": ctx.dp_size, "rank": ctx.dp_rank}

    @property
    def parallel(self) -> Parallelism:
        ctx, cfg = self._ctx, self.config
        sequences = {"cp": cfg.cp, "sequence_multiple": cfg.sequence_multiple}
        if ctx is None:  # before setup_environment: what the config alone says
            return Parallelism(**sequences)
        topology = {
            "tp": ctx.tp_size,
            "pp": ctx.pp_size,
            "cp": ctx.cp_size,
            "dp": ctx.dp_size,
            "world_size": ctx.world_size,
            "zero_stage": cfg.zero_stage,
            "sequence_parallel": cfg.sequence_parallel,
        }
        return Parallelism(
            context=ctx,
            dp=ctx.dp_size,
            pipelined=self.stage is not None,
            # the ranks holding the global batch's other samples: dp replicas, the context's "batch"
            # group (cp ranks hold other tokens of the same samples)
            loss_group=(ctx.group("batch"), ctx.size("batch")),
            topology=topology,
            **sequences,
        )

    def shard_batch(self, batch: Any) -> Any:
        """cp > 1: this rank's zigzag chunks (`ring_attention.zigzag_shard`) of every per-token
        tensor of the batch dict, and each token's global position (``position_ids``) for RoPE
        when the batch brings none; a whole sequence is read and split here, after transfer."""
        cp = self.config.cp
        if cp == 1:
            return batch
        ids = batch.get("input_ids") if isinstance(batch, dict) else None
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise UsageError(
                "context parallelism splits each batch's sequences: it needs a dict with input_ids (B, T) "
                f"and per-token tensors of the same shape, got {type(batch).__name__}; set +parallel.cp=1 "
                "for other batches"
            )
        self.config.check_sequence(ids.shape[1])
        if "labels" in batch and "target_ids" not in batch:  # a shard cannot shift its own labels
            raise UsageError(
                "context parallelism splits each sequence, so its next-token targets are made while it is "
                "whole: give the batch target_ids (nanolight.models.llama.shift_labels(labels)) and call the "
                "model with target_ids= instead of labels="
            )
        out = dict(batch)
        out.setdefault("position_ids", torch.arange(ids.shape[1], device=ids.device).expand_as(ids))
        rank = self._ctx.cp_rank
        for key, value in out.items():
            if isinstance(value, torch.Tensor) and value.shape[:2] == ids.shape:
                out[key] = zigzag_shard(value, rank, cp, dim=1)
        return out

    def gather_sequence(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.cp == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.config.cp)]
        # every cp rank sends its share of the sequence to every other one
        dist.all_gather(parts, x.contiguous(), group=self._ctx.cp_group)
        return zigzag_unshard(parts, dim=1)

    # ---- lifecycle -----------------------------------------------------------------------
    def setup_environment(self) -> None:
        if self._ctx is None:
            cfg, env = self.config, detect_environment()
            replicas = 1 if cfg.dp == "auto" else cfg.dp  # plain python: dp="auto" is one replica
            world = env.world_size if env is not None else cfg.replica_ranks * replicas
            fake = dist.is_initialized() and dist.get_backend() == "fake"  # the dry run's world, joined
            if fake:
                world = dist.get_world_size()
            dp = cfg.resolve_dp(world)  # world must be tp*pp*cp*dp: a clear error, before anything starts
            if not fake:
                env = ensure_processes(world)  # plain python, world > 1: re-launches and never returns
                self._local_rank = env.local_rank
                self.heartbeat = init_distributed(env, self.backend, self.timeout, self.device_ids)
            self._ctx = ParallelContext(tp=cfg.tp, pp=cfg.pp, dp=dp, cp=cfg.cp, timeout=self.timeout)
            atexit.register(self._shutdown)
        super().setup_environment()

    def _shutdown(self) -> None:  # at exit: the heartbeat first (it talks to rank 0's store), then the groups
        if self.heartbeat is not None:
            self.heartbeat.close()
        self._ctx.destroy()

    def tensor_init_context(self) -> AbstractContextManager:
        # the full model is never materialised on one rank (dp alone replicates it anyway)
        return torch.device("meta") if self.config.tp * self.config.pp > 1 else super().tensor_init_context()

    def setup_module(self, module: nn.Module) -> nn.Module:
        ctx, cfg = self._ctx, self.config
        model, prefix = find_plan_model(module, required=cfg.replica_ranks > 1)
        self.module = module
        if self.pretrained is not None:  # its exports keep the starting directory's HF token ids
            self.export = carried_extras(self.pretrained, self.export)
        if model is None:  # any nn.Module under plain data parallelism: every rank holds it whole
            module.to(self.root_device)
            self.layout = replicated_layout(module, ctx)
            self.precision.convert_module(module)
            broadcast_replicas(module, ctx)
            return module
        sharded = shard_model(module, model, prefix, ctx, cfg, self.root_device, self.pp_layers_per_stage)
        self.layout = sharded.layout
        if self.pretrained is not None:  # this rank's slices of a model directory (the model's keys)
            reader = CheckpointReader.open(self.pretrained)
            load_model(reader, module, self.layout, prefix, stored_model_prefix(self.pretrained))
        elif sharded.on_meta:  # rank 0's seed for all (each process's own initial seed differs)
            seed = self.broadcast(self.init_seed if self.init_seed is not None else torch.initial_seed())
            gen = torch.Generator().manual_seed(seed)
            init_replayed_(model, sharded.specs, gen, shard_dims(model), ctx.tp_rank, ctx.tp_size)
        if cfg.cp > 1:  # this stage's attention layers: ring attention over the cp group
            if not hasattr(model, "set_attention_backend"):
                raise UsageError(
                    f"context parallelism (cp={cfg.cp}) replaces the model's attention with ring attention, "
                    f"but {type(model).__name__} has no set_attention_backend (models/llama.py has); set +parallel.cp=1"
                )
            model.set_attention_backend(RingAttention(ctx.cp_group, ctx.cp_ranks))
        self.precision.convert_module(module)
        self.compiled = self.blocks.apply(module, self.is_global_zero)  # after tp and the split, before dp
        if sharded.split is not None:
            self.stage = PipelineStage.of(model, sharded.split, ctx, compute_context=self.autocast)
        if not sharded.on_meta:
            broadcast_replicas(module, ctx)  # each rank built (and sliced) its own
        return module

    def setup_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> list[Any]:
        """Gradient synchronisation, and ZeRO-1 around the optimizer (`parallel/grads.py`).

        ``bf16-master``: the ZeRO-1 optimizer holds the fp32 masters and main gradients (at dp=1
        too: one shard), then the model becomes bf16; with replicas the post-step all-gather of bf16
        weights is waited for bucket by bucket in the next forward (not under compile, whose
        blocks would trace the hooks). ZeRO-1 over one replica has nothing to shard: the plain
        optimizer, as on one process (its masters would be a second copy of the weights, 4 bytes
        a parameter at 32-true, for the same update)."""
        cfg, master = self.config, self.precision.master_weights
        replicas = self._ctx.size("replica")  # dp x cp: the ranks the optimizer state shards over
        self.precision.check_layout(cfg.zero_stage, replicas)
        zero, dtype = (1, torch.float32) if master else (cfg.zero_stage if replicas > 1 else 0, None)
        self.grads = GradientSync(
            self.module, self.layout, self._ctx, cfg.sequence_parallel, zero, self.dp_bucket_bytes, dtype
        )
        self.optimizers = self.grads.wrap_optimizers(list(optimizers))
        if master:
            self.precision.cast_to_compute(self.module)
            blocks = _last_block(self.module)
            if replicas > 1 and not self.blocks.compile and blocks is not None:
                self.grads.zero.overlap_weight_gather(self.module.modules(), blocks)
        return self.optimizers

    # ---- one optimizer step --------------------------------------------------------------
    def run_step(self, n: int) -> Iterator[Action]:
        if self.stage is None:
            for kind, i in super().run_step(n):
                if kind == BACKWARD:  # the dp reduction runs in the step's last backward only
                    self.grads.require_sync(i == n - 1)
                yield kind, i
            return
        check_micro_batches(self._ctx.pp_size, self.config.pp_schedule, n)
        # the stage runs its program (the dp reduction in each chunk's last backward)
        steps = self.stage.run_step(self.config.pp_schedule, n, self.grads.require_sync)
        while True:
            with watch("the pipeline's chunks and exchanges between the trainer's calls", self.heartbeat):
                action = next(steps, None)
            if action is None:
                return
            yield action

    def autocast(self) -> AbstractContextManager:
        stack = ExitStack()
        stack.enter_context(watch("a forward (tp collectives, pipeline exchanges)", self.heartbeat))
        stack.enter_context(super().autocast())
        return stack

    @watched("a backward (the pipeline's gradient exchange, or the dp reduction)")
    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        if self.stage is not None:
            self.stage.backward(loss)  # the due micro-batch's chunk backward (receive, backward, send)
        else:
            loss.backward(*args, **kwargs)  # (manual optimization's retain_graph; pp refuses it)

    @watched("the gradient synchronisation over tp / pp / dp")
    def finish_backward(self) -> None:
        self.grads.finish()

    def zero_grad(self, optimizer: Any) -> None:
        self.grads.zero_grad(optimizer)

    @watched("the global gradient norm (summed over tp / pp / dp)")
    def clip_gradients(
        self, value: float | None, optimizer: Any = None, algorithm: str = "norm"
    ) -> torch.Tensor | None:
        if algorithm == "value":  # elementwise: no communication
            assert value is not None
            self.grads.clip_value_(value)
            return None
        return self.grads.clip_(value)  # every parameter: the norm of all of them, on all ranks

    # ---- collectives ---------------------------------------------------------------------
    @watched("the loss/metric reduction (from the last pipeline stage, over dp)")
    def reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        return self._ctx.reduce_metric(tensor, op, from_last_stage=self.stage is not None)

    @watched("a barrier")
    def barrier(self, name: str | None = None) -> None:
        if self._ctx is not None:
            dist.barrier()  # every rank of the world waits for all the others; nothing is exchanged

    @watched("a broadcast from rank 0")
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self._ctx is None:
            return obj
        return self._ctx.broadcast_object(obj, src)  # rank `src` sends obj to every rank over the host group

    def watch(self, what: str) -> AbstractContextManager:
        return watch(what, self.heartbeat)

    def agree_max(self, value: int) -> Any:  # one process: already agreed; else on the host
        watching = functools.partial(
            watch, "a host agreement (pre-emption flags, a bad step)", self.heartbeat
        )
        return super().agree_max(value) if self._ctx is None else self._ctx.agree_max(value, watching)


def _last_block(module: nn.Module) -> nn.Module | None:
    """This rank's last decoder block (it runs before any read of the head), or None without blocks."""
    try:
        _, blocks = decoder_blocks(module)
    except TypeError:
        return None
    return max(blocks, key=lambda b: b[0])[1] if blocks else None
