"""`Strategy`: the one seam between the trainer and *where/how* the model runs.

The trainer holds no parallel code. Every question whose answer depends on the layout -- which
device, how many ranks, in which order this rank runs the micro-batches' forwards and backwards,
how gradients become final, how a metric is reduced, how a checkpoint is written and resharded --
is a method here. A strategy says *what*; the parallel core (`nanolight/parallel/`) and the
checkpoint format (`nanolight/checkpoint/`) say *how*. This base is one process on one device;
`Parallel3DStrategy` composes tensor, pipeline and data parallelism.

Call order during ``NanoTrainer.fit`` (each a method below)::

    setup_environment()                 # processes, process groups, device, rank_zero_only.rank
    with tensor_init_context():         # e.g. the meta device
        module.configure_model()        # (trainer) the user's plain model
    setup_module(module)                # parallelize / move / cast; records `layout`
    setup_optimizers(optimizers)        # wraps configure_optimizers' optimizers (ZeRO, ...)
    load_checkpoint(path, load_optimizer=False) -> trainer state     # only when resuming
    load_checkpoint(path, load_weights=False)                        # its optimizer state, later
    per optimizer step (the order: ARCHITECTURE.md, "How one optimizer step flows"):
        shard_batch, token_mean, run_step, autocast, backward, finish_backward, reduce,
        clip_gradients, optimizer_step, zero_grad, agree_max
    save_checkpoint(path, state)        # ModelCheckpoint -> trainer.save_checkpoint (all ranks)
    broadcast / barrier                 # whenever ranks must agree; watch(what) around any stage
    teardown()

What the layout means to the trainer and the callbacks (data-parallel replicas, sequence shards,
pipelining, the process groups) is one read-only answer, `parallel` (a `Parallelism`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nanolight.checkpoint.load import load_model, load_optimizers, trainer_state
from nanolight.checkpoint.reader import CheckpointReader
from nanolight.checkpoint.save import ExportExtras, save_checkpoint
from nanolight.parallel.agreement import agreed
from nanolight.parallel.blocks import BlockOptions, CompiledBlocks
from nanolight.parallel.grads import clip_, global_norm
from nanolight.parallel.layout import ModelLayout
from nanolight.parallel.loss_tokens import loss_divisor, step_targets
from nanolight.parallel.pipeline.schedules import BACKWARD, FORWARD, Action, one_by_one
from nanolight.parallel.zero import ZeroOptimizer, masters_in_model
from nanolight.precision import Precision

__all__ = ["BACKWARD", "FORWARD", "Action", "Parallelism", "Strategy"]


@dataclass(frozen=True)
class Parallelism:
    """What the layout means to the trainer and the callbacks, answered in one place (defaults: one
    process). The strategy builds it when asked (`Strategy.parallel`): the groups exist once
    `setup_environment` ran, `pipelined` once `setup_module` did."""

    context: Any = None  # the ParallelContext (ranks, process groups); None without parallelism
    dp: int = 1  # data-parallel replicas: tokens per step = a rank's tokens x this (ThroughputMonitor)
    cp: int = 1  # ranks splitting each sequence (context parallelism): each holds 1/cp of its tokens
    # sequence lengths must be a multiple of this (cp's zigzag chunks; tp under sequence parallelism)
    sequence_multiple: int = 1
    pipelined: bool = False  # only the last stage computes the loss; every stage runs every micro-batch
    # (process group, size) whose ranks' micro-batches make up one global batch: the step's valid
    # targets are counted over it (`Strategy.token_mean`)
    loss_group: tuple[Any, int] = (None, 1)
    # the layout recorded in checkpoints (a resume at the same one restores per-rank state)
    topology: dict[str, Any] = field(default_factory=lambda: {"tp": 1, "pp": 1, "dp": 1, "world_size": 1})

    @property
    def metrics_always_sync(self) -> bool:
        """Every logged value is reduced as if ``sync_dist=True``: a value from one pipeline stage (only
        the last computes the loss), or from one cp rank's share of the tokens, is partial."""
        return self.pipelined or self.cp > 1


class Strategy:
    """Base strategy. Subclasses must set `root_device`; everything else has a 1-process default."""

    def __init__(self, precision: str | Precision = "32-true", export: ExportExtras | None = None) -> None:
        self.precision = precision if isinstance(precision, Precision) else Precision(precision)
        self.export = export  # what a run adds to each checkpoint so it exports complete (the recipe's)
        self.module: nn.Module | None = None  # the NanoModule being trained
        self.optimizers: list[torch.optim.Optimizer] = []
        self.layout: ModelLayout | None = None  # where each tensor lives (set by setup_module)
        self._ctx: Any = None  # the ParallelContext, once a parallel strategy's setup_environment made it

    # ---- topology ------------------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        """The device this rank computes on; batches are moved there."""
        raise NotImplementedError

    @property
    def world_size(self) -> int:
        return self._ctx.world_size if self._ctx is not None else 1

    @property
    def global_rank(self) -> int:
        return self._ctx.global_rank if self._ctx is not None else 0

    @property
    def is_global_zero(self) -> bool:
        """True on the one rank that logs, prints and writes shared files."""
        return self.global_rank == 0

    @property
    def local_rank(self) -> int:
        """This process's index on its node (prepare_data runs where it is 0)."""
        return 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int] | None:
        """``num_replicas``/``rank`` a plain DataLoader's DistributedSampler gets (None: no sharding)."""
        return None

    @property
    def parallel(self) -> Parallelism:
        """What the layout means to the trainer and the callbacks (`Parallelism`): one process here."""
        return Parallelism()

    def shard_batch(self, batch: Any) -> Any:
        """This rank's share of a transferred batch: its chunks of every sequence under cp."""
        return batch

    def gather_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """The whole sequence (dim 1) of a tensor computed on this rank's share (`shard_batch`)."""
        return x

    # ---- lifecycle -----------------------------------------------------------------------
    def setup_environment(self) -> None:
        """Create processes / process groups and pick the device. Called first in fit/validate."""
        from lightning_utilities.core.rank_zero import rank_zero_only

        rank_zero_only.rank = self.global_rank  # lightning-utilities' rank-zero helpers read this
        self.precision.setup_device(self.root_device)  # 32-true on CUDA: TF32 (precision.py)

    def tensor_init_context(self) -> AbstractContextManager:
        """Context ``configure_model`` runs in (Lightning's name): the default device here; a parallel
        strategy may build on ``meta`` (no rank ever holds the full model)."""
        return nullcontext()

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Move/cast/parallelize the freshly configured module; returns what the trainer trains."""
        if any(t.device != self.root_device for t in [*module.parameters(), *module.buffers()]):
            module.to(self.root_device)  # not a no-op move: torch swaps fake tensors (the dry run's), refused
        self.precision.convert_module(module)
        self.module, self.layout = module, ModelLayout.whole(module)
        return module

    def setup_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
        """Wrap the optimizers from ``configure_optimizers`` (ZeRO sharding goes here). ``bf16-master``:
        each steps fp32 master copies (a one-rank `ZeroOptimizer`), then the model becomes bf16."""
        self.optimizers = list(optimizers)
        if self.precision.master_weights:
            self.optimizers = [ZeroOptimizer(opt, None, grad_dtype=torch.float32) for opt in optimizers]
            self.precision.cast_to_compute(self.module)
        return self.optimizers

    def teardown(self) -> None:
        """Release what `setup_environment` acquired (process groups, CUDA cache)."""

    # ---- one optimizer step --------------------------------------------------------------
    @contextmanager
    def token_mean(self, batches: Sequence[Any], whole_step: bool = True) -> Iterator[None]:
        """Around one optimizer step of `batches` (the trainer's micro-batches, before transfer):
        when every one carries `target_ids`, each model that divides its own token-loss sum
        (declares `loss_divisor`, e.g. the causal LM of `models/`) divides it by the step's count, so the
        step's loss and gradients are the exact token mean over every micro-batch and every rank
        of `loss_group` (`parallel/loss_tokens.py`). Other losses keep Lightning's semantics.
        ``whole_step=False``, around one evaluation batch: only the ranks splitting its sequences
        share its count, so the mean of their losses is the batch's own token mean, as on one
        process (without context parallelism there is nothing to do)."""
        targets, parallel = step_targets(batches), self.parallel
        assert self.module is not None
        wanted = targets and (whole_step or parallel.cp > 1)
        models = [m for m in self.module.modules() if hasattr(m, "loss_divisor")] if wanted else []
        if not models:
            yield
            return
        group, size = parallel.loss_group if whole_step else (None, 1)
        with self.watch("the count of the step's valid targets (an all-reduce over the loss group)"):
            divisor = loss_divisor(targets, self.root_device, group, size, parallel.cp)
        for model in models:
            model.loss_divisor = divisor
        try:
            yield
        finally:
            for model in models:
                model.loss_divisor = None  # outside a training step: the plain mean again

    def run_step(self, n: int) -> Iterator[Action]:
        """Runs one optimizer step's schedule over `n` micro-batches, stopping where the trainer's
        part is due: (FORWARD, i) -- training_step for micro-batch i; (BACKWARD, i) -- back-propagate
        its loss / n. One process: each micro-batch's forward, then its backward."""
        yield from one_by_one(n)

    def autocast(self) -> AbstractContextManager:
        """Around every forward (training_step, validation_step, ...): bf16-mixed autocast."""
        return self.precision.autocast(self.root_device)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Back-propagate `loss` (already scaled for accumulation): the micro-batch `run_step` has
        due (outside a step, e.g. manual optimization: a whole step's one); `args`/`kwargs` are
        manual_backward's, e.g. ``retain_graph=True``."""
        loss.backward(*args, **kwargs)

    def finish_backward(self) -> None:
        """After the step's last backward: make the gradients final (a parallel strategy syncs them)."""

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop gradients before the first micro-batch of a step (set_to_none saves memory)."""
        optimizer.zero_grad(set_to_none=True)

    def clip_gradients(
        self, value: float | None, optimizer: Any = None, algorithm: str = "norm"
    ) -> torch.Tensor | None:
        """Lightning's two algorithms. ``"norm"``: clip by the global L2 norm (`value` None: only
        measure) and return the pre-clip norm; one process: torch's own over `optimizer`'s
        parameters (all of them when None); a parallel strategy sums the norm over its ranks
        (`parallel/grads.py`). ``"value"``: clamp every element to [-value, value] (no
        communication), returns None. ``bf16-master``: the fp32 gradients the masters step with."""
        if algorithm == "value":
            assert value is not None
            self._clip_values(value, optimizer)
            return None
        max_norm, masters = value, self._masters(optimizer)
        if masters:
            grads = [g for opt in masters for g in opt.grad_pieces({id(p) for p in self._params(opt)})]
            norm = global_norm(grads).to(self.root_device)
            if max_norm is not None:
                clip_(grads, norm, max_norm)
            return norm
        params = [p for p in self._params(optimizer) if p.grad is not None]
        if not params:
            return torch.zeros((), device=self.root_device)
        if max_norm is None:
            return torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)

    def _clip_values(self, value: float, optimizer: Any) -> None:
        for opt in self._masters(optimizer):
            for grad in opt.reduced_grads():
                grad.clamp_(-value, value)
        params = [p for p in self._params(optimizer) if p.grad is not None]
        if params:
            torch.nn.utils.clip_grad_value_(params, value, foreach=True)

    def _masters(self, optimizer: Any = None) -> list[ZeroOptimizer]:
        """The optimizers (or `optimizer`) that step fp32 masters of the model's weights (``bf16-master``)."""
        candidates = self.optimizers if optimizer is None else [optimizer]
        return [opt for opt in candidates if isinstance(opt, ZeroOptimizer) and opt.master_weights]

    def _params(self, optimizer: Any) -> list[nn.Parameter]:
        assert self.module is not None
        if optimizer is None:
            return list(self.module.parameters())
        return [p for g in optimizer.param_groups for p in g["params"]]

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Apply the update (ZeRO-1 also all-gathers the updated weights over dp here)."""
        with self.watch("the optimizer step (ZeRO-1's all-gather of the updated weights over dp)"):
            optimizer.step()

    # ---- collectives ---------------------------------------------------------------------
    def reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """A metric as every rank must see it ("mean", "sum", "max" or "min" over dp); identity
        on one process."""
        return tensor

    def barrier(self, name: str | None = None) -> None:
        """Wait for all ranks."""

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Send a picklable object from ``src`` to every rank (e.g. the resolved checkpoint path)."""
        return obj

    def agree_max(self, value: int) -> Any:
        """Start agreeing on the maximum of a non-negative int over every rank, on the host, without
        waiting (pre-emption: which signal reached any rank; ``bool(agree_max(int(flag)).wait())``:
        whether any rank's flag is set); ``.wait()`` returns it (`ParallelContext.agree_max`). One
        process: already agreed (a done torch `Future`)."""
        return agreed(value)

    def watch(self, what: str) -> AbstractContextManager:
        """Around work that may wait on peers: a stopped peer becomes an error naming it."""
        return nullcontext()

    # ---- checkpoints ---------------------------------------------------------------------
    def save_checkpoint(self, path: str | Path, state: dict[str, Any], weights_only: bool = False) -> None:
        """Write checkpoint directory `path` atomically: every rank its part of the weights and of
        the optimizer state (not with `weights_only`), rank 0 the trainer's `state` (tensors and
        plain containers only: read back with ``torch.load(weights_only=True)``), `export` and
        the index (`checkpoint/save.py`; collective when there are several ranks)."""
        assert self.module is not None and self.layout is not None
        optimizers = [] if weights_only else self.optimizers
        ranks, topology = self._ctx is not None, self.parallel.topology
        # bf16-master: the fp32 masters are what is written
        with self.watch("a checkpoint save"), masters_in_model(self.optimizers):
            save_checkpoint(
                Path(path),
                self.module,
                optimizers,
                self.layout,
                state,
                topology,
                self.root_device,
                self.export,
                ranks,
            )

    def load_checkpoint(
        self, path: str | Path, load_optimizer: bool = True, load_weights: bool = True
    ) -> dict[str, Any]:
        """Load this rank's part of the weights and of the optimizer state from a checkpoint of any
        layout; returns the trainer state saved with it. A resume loads the weights at setup
        (``load_optimizer=False``) and the optimizer state once the optimizers exist
        (``load_weights=False``)."""
        assert self.module is not None and self.layout is not None
        with self.watch("loading a checkpoint"):
            reader = CheckpointReader.open(path)
            if load_weights:
                with masters_in_model(self.optimizers):  # bf16-master: the fp32 values reach the masters
                    load_model(reader, self.module, self.layout)
                    for opt in self.optimizers:  # ZeRO-1's fp32 master copy follows the new weights
                        if isinstance(opt, ZeroOptimizer):
                            opt.reload_master_weights()
            if load_optimizer:
                load_optimizers(reader, self.optimizers, self.module, self.layout)
            ctx = self._ctx  # a data position is per dp rank
            return trainer_state(reader, self.global_rank, self.parallel.topology, ctx.dp_rank if ctx else 0)


# ---- one process on one device -------------------------------------------------------------------
#
# `SingleDeviceStrategy`: one process on one CPU or one GPU -- the base defaults, plus a device.


class SingleDeviceStrategy(Strategy):
    """Train on ``device`` (default: ``cuda:0`` if available, else CPU).

    `activation_checkpointing` ("none" | "full" | "selective", on every
    `activation_checkpointing_every`-th decoder block) and `compile` (each decoder block) act on
    the model's blocks after it is moved and cast (`parallel/blocks.py`). `export`: what
    the run adds to each checkpoint so it exports complete (`ExportExtras`).
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        precision: str | Precision = "32-true",
        *,
        activation_checkpointing: str = "none",
        activation_checkpointing_every: int = 1,
        compile: bool = False,
        export: ExportExtras | None = None,
    ):
        super().__init__(precision, export)
        if device is None:
            device = "cuda:0" if torch.cuda.is_available() else "cpu"
        self._device = torch.device(device)
        self.blocks = BlockOptions(activation_checkpointing, activation_checkpointing_every, compile)
        self.compiled: CompiledBlocks | None = None  # set by setup_module when compiling

    @property
    def root_device(self) -> torch.device:
        return self._device

    def setup_module(self, module: nn.Module) -> nn.Module:
        module = super().setup_module(module)
        self.compiled = self.blocks.apply(module)
        return module

    def setup_environment(self) -> None:
        super().setup_environment()
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)

    def teardown(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
