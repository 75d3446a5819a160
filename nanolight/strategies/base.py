"""`Strategy`: the one seam between the trainer loop and *where/how* the model runs.

The trainer (``nanolight/trainer.py``) holds no parallel code. Every question whose answer
depends on the layout -- which device, how many ranks, how to reduce a metric, how to run the
micro-batches of one optimizer step, how to clip by the global norm, how to save a (possibly
sharded) checkpoint -- is a method here. `SingleDeviceStrategy` implements them for one CPU or
GPU; ``Parallel3DStrategy`` overrides them for tensor/pipeline/data parallelism.

Call order during ``NanoTrainer.fit`` (each a method below)::

    setup_environment()                 # processes, process groups, device, rank_zero_only.rank
    with model_init_context():          # init_device(), e.g. meta
        module.configure_model()        # (trainer) the user's plain model
    setup_module(module)                # parallelize / move / cast (precision.convert_module)
    setup_optimizers(optimizers)        # wraps configure_optimizers' optimizers (ZeRO, ...)
    load_checkpoint(path, load_optimizer=False) -> trainer state     # only when resuming
    load_optimizer_state_dict(states)                                # only when resuming
    per optimizer step:
        batch_to_device(batch)          # each micro-batch (+ bf16-true input cast)
        training_step(micro_batches, micro_step) -> mean loss   # forward/backward per micro-batch
            [autocast() around the user's training_step, inside micro_step]
            zero_grad(optimizer)        # via micro_step, after micro-batch 0's forward
            backward(loss / n)          # via micro_step.backward, once per micro-batch
        clip_gradients(max_norm) -> pre-clip global grad norm   # only if gradient_clip_val
        optimizer_step(optimizer)
        reduce(tensor, "mean")          # metrics: train/loss always, sync_dist=True ones
        any_rank(signal_received)       # preemption: did any rank get SIGTERM/SIGUSR1?
    save_checkpoint(path, state)        # ModelCheckpoint -> trainer.save_checkpoint (all ranks)
    broadcast / barrier                 # whenever ranks must agree
    teardown()

Override at the granularity you need: a strategy whose ranks hold slices overrides
`save_checkpoint` / `load_checkpoint` / `load_optimizer_checkpoint` (``Parallel3DStrategy``
writes per-rank shards plus an index, ``sharded_checkpoint.py``); the base versions write the
single-device files on global rank zero, and read both that layout and a sharded one (assembling
full tensors), so a run saved at any parallel layout resumes on one device.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from lightning_utilities.core.apply_func import apply_to_collection

from nanolight.checkpoint.pretrained import CONFIG_FILE, step_dir_meta
from nanolight.checkpoint.sharded import ShardedReader, is_sharded_checkpoint
from nanolight.checkpoint.trainer_state import (
    atomic_checkpoint_dir,
    load_model_file,
    load_torch_file,
    save_model_file,
    save_torch_file,
)
from nanolight.precision import Precision

if TYPE_CHECKING:
    from nanolight.module import NanoModule


class MicroStepFn(Protocol):
    """What the trainer hands to `Strategy.training_step` (see ``nanolight/loop/step.py``).

    ``micro_step(batch, i) -> loss`` runs the train-batch-start hooks and the user's
    ``training_step`` for micro-batch ``i`` (0..n-1 within this optimizer step) and returns the
    unscaled scalar loss. ``micro_step.backward(loss, i)`` fires the backward hooks around
    `Strategy.backward` (the loss passed in is already divided by n) and, for all but the last
    micro-batch, ``on_train_batch_end``. A pipeline engine calls ``micro_step`` in schedule order
    on the stage that owns the loss and drives the other stages' backward itself.
    """

    def __call__(self, batch: Any, batch_idx: int) -> torch.Tensor: ...

    def backward(self, loss: torch.Tensor, batch_idx: int) -> None: ...


class Strategy:
    """Base strategy. Subclasses must set `root_device`; everything else has a 1-process default."""

    def __init__(self, precision: str | Precision = "32-true") -> None:
        self.precision = precision if isinstance(precision, Precision) else Precision(precision)
        self.module: NanoModule | None = None
        self.optimizers: list[torch.optim.Optimizer] = []

    # ---- topology ------------------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        """The device this rank computes on; batches are moved there."""
        raise NotImplementedError

    @property
    def world_size(self) -> int:
        """Total number of processes."""
        return 1

    @property
    def global_rank(self) -> int:
        """This process's rank in the world."""
        return 0

    @property
    def is_global_zero(self) -> bool:
        """True on the one rank that logs, prints and writes shared files."""
        return self.global_rank == 0

    @property
    def data_parallel_size(self) -> int:
        """Number of data-parallel replicas: tokens/step = local tokens x this (ThroughputMonitor)."""
        return 1

    @property
    def parallel_context(self) -> Any:
        """The ParallelContext (process groups), or None when there is no parallelism."""
        return None

    # ---- lifecycle -----------------------------------------------------------------------
    def setup_environment(self) -> None:
        """Create processes / process groups and pick the device. Called first in fit/validate."""
        from lightning_utilities.core.rank_zero import rank_zero_only

        rank_zero_only.rank = self.global_rank  # lightning-utilities' rank-zero helpers read this

    def init_device(self) -> torch.device | None:
        """Device to build the model on in ``configure_model`` (e.g. ``meta``); None = default."""
        return None

    def setup_module(self, module: NanoModule) -> NanoModule:
        """Move/cast/parallelize the freshly configured module; returns what the trainer trains."""
        module.to(self.root_device)
        self.precision.convert_module(module)
        self.module = module
        return module

    def setup_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
        """Wrap the optimizers from ``configure_optimizers`` (ZeRO sharding goes here)."""
        self.optimizers = list(optimizers)
        return self.optimizers

    def teardown(self) -> None:
        """Release what `setup_environment` acquired (process groups, CUDA cache)."""

    def batch_to_device(self, batch: Any) -> Any:
        """Move a batch to `root_device` (and cast it for ``bf16-true``)."""
        if self.root_device.type != "cpu":
            batch = apply_to_collection(
                batch, torch.Tensor, lambda t: t.to(self.root_device, non_blocking=True)
            )
        return self.precision.convert_input(batch)

    # ---- one optimizer step --------------------------------------------------------------
    def autocast(self) -> AbstractContextManager:
        """Context for forward passes (bf16-mixed autocast); the trainer wraps training/validation_step."""
        return self.precision.autocast(self.root_device)

    def training_step(self, micro_batches: Sequence[Any], micro_step: MicroStepFn) -> torch.Tensor:
        """Run forward+backward for every micro-batch of one optimizer step; return the mean loss.

        Gradients accumulate in ``param.grad`` (fp32 with bf16-mixed). Each micro-batch's loss
        is divided by ``n`` before backward so the accumulated gradient equals that of one big
        batch. A pipeline strategy overrides this to run its schedule; a data-parallel one
        suppresses gradient sync on all but the last micro-batch.
        """
        n = len(micro_batches)
        losses = []
        for i, batch in enumerate(micro_batches):
            loss = micro_step(batch, i)
            micro_step.backward(loss / n, i)
            losses.append(loss.detach())
        return torch.stack(losses).float().mean()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one (already 1/n-scaled) micro-batch loss."""
        loss.backward()

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop gradients before the first micro-batch of a step (set_to_none saves memory)."""
        optimizer.zero_grad(set_to_none=True)

    def parameters_for_clipping(self) -> list[torch.Tensor]:
        """Parameters whose grads enter the global norm (a sharded strategy returns local shards)."""
        assert self.module is not None
        return [p for p in self.module.parameters() if p.grad is not None]

    def clip_gradients(self, max_norm: float | None) -> torch.Tensor:
        """Clip by the global L2 norm (``max_norm`` None: only measure); returns the pre-clip norm.

        A 3D strategy must all-reduce the squared local norms over tp/pp (and dp for sharded
        grads) before clipping -- override this method.
        """
        params = self.parameters_for_clipping()
        if not params:
            return torch.zeros((), device=self.root_device)
        if max_norm is None:
            return torch.nn.utils.get_total_norm([p.grad for p in params])
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Apply the update (a ZeRO strategy also all-gathers updated shards here)."""
        optimizer.step()

    # ---- collectives ---------------------------------------------------------------------
    def reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """Reduce a metric over data-parallel ranks ("mean" or "sum"); identity on one process."""
        return tensor

    def barrier(self, name: str | None = None) -> None:
        """Wait for all ranks."""

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Send a picklable object from ``src`` to every rank (e.g. the resolved checkpoint path)."""
        return obj

    def any_rank(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is True on any rank (e.g. "a signal reached me")."""
        return flag

    # ---- checkpoints ---------------------------------------------------------------------
    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights to save, keyed by stable (unsharded) names. Sharded strategies save local shards."""
        assert self.module is not None
        return self.module.state_dict()

    def load_model_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load weights; a mismatching checkpoint raises naming the offending keys/shapes."""
        assert self.module is not None
        check_state_dict_matches(self.module.state_dict(), state)
        self.module.load_state_dict(state, strict=True)

    def optimizer_state_dict(self) -> list[dict[str, Any]]:
        """One state dict per optimizer (a ZeRO strategy returns this rank's shard)."""
        return [opt.state_dict() for opt in self.optimizers]

    def load_optimizer_state_dict(self, states: list[dict[str, Any]]) -> None:
        if len(states) != len(self.optimizers):
            raise ValueError(
                f"checkpoint holds {len(states)} optimizer state(s) but configure_optimizers "
                f"returned {len(self.optimizers)}"
            )
        for opt, state in zip(self.optimizers, states, strict=True):
            opt.load_state_dict(state)

    def checkpoint_files(self) -> dict[str, str]:
        """File names inside a checkpoint directory. A sharded strategy adds the rank to them."""
        return {"model": "model.safetensors", "optimizer": "optimizer.pt", "trainer": "trainer_state.pt"}

    def save_checkpoint(self, path: str | Path, state: dict[str, Any]) -> None:
        """Write ``path`` atomically: model weights, optimizer state and the trainer's ``state``.

        ``state`` must hold only tensors and plain Python containers (it is read back with
        ``torch.load(weights_only=True)``). The directory is built under a temporary name,
        fsynced, then renamed, so a crash never leaves a half-written ``step-N``.
        """
        files = self.checkpoint_files()
        model_state = self.model_state_dict()
        optim_state = self.optimizer_state_dict()
        if self.is_global_zero:
            with atomic_checkpoint_dir(Path(path)) as tmp:
                save_model_file(tmp / files["model"], model_state)
                save_torch_file(tmp / files["optimizer"], optim_state)
                save_torch_file(tmp / files["trainer"], state)
                meta = step_dir_meta(self.module, index=None)  # a Llama inside: also a model dir
                if meta is not None:
                    (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        self.barrier("save_checkpoint")

    def load_checkpoint(self, path: str | Path, load_optimizer: bool = True) -> dict[str, Any]:
        """Load weights (+ optimizer state) from ``path``; returns the trainer ``state`` dict.

        Reads this strategy's own format and, on one device, a sharded checkpoint saved by
        ``Parallel3DStrategy`` at any topology (its tensors are assembled in full)."""
        path = Path(path)
        files = self.checkpoint_files()
        if is_sharded_checkpoint(path):
            self.load_model_state_dict(ShardedReader(path).model_state())
        else:
            self.load_model_state_dict(load_model_file(path / files["model"], self.root_device))
        if load_optimizer:
            self.load_optimizer_checkpoint(path)
        trainer_file = path / files["trainer"]
        return load_torch_file(trainer_file, "cpu") if trainer_file.exists() else {}

    def load_optimizer_checkpoint(self, path: str | Path) -> None:
        """Load the optimizer state(s) stored in checkpoint directory ``path`` (if it has any)."""
        path = Path(path)
        if is_sharded_checkpoint(path):
            from nanolight.strategies.sharded_checkpoint import load_optimizer_states

            assert self.module is not None
            load_optimizer_states(
                ShardedReader(path), self.optimizers, self.module, lambda key, p: (None, None)
            )
            return
        file = path / self.checkpoint_files()["optimizer"]
        if file.exists():
            self.load_optimizer_state_dict(load_torch_file(file, self.root_device))

    def model_init_context(self) -> AbstractContextManager:
        """Context ``configure_model`` runs in (e.g. ``torch.device('meta')``)."""
        device = self.init_device()
        return torch.device(device) if device is not None else nullcontext()


def check_state_dict_matches(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    """Raise a ValueError listing missing/unexpected keys and shape mismatches (first few of each)."""
    missing = [k for k in expected if k not in got]
    unexpected = [k for k in got if k not in expected]
    shapes = [
        f"{k}: checkpoint {tuple(got[k].shape)} vs model {tuple(v.shape)}"
        for k, v in expected.items()
        if k in got and tuple(got[k].shape) != tuple(v.shape)
    ]
    if not (missing or unexpected or shapes):
        return

    def head(items: list[str]) -> str:
        return ", ".join(items[:8]) + (f", ... ({len(items)} total)" if len(items) > 8 else "")

    parts = []
    if missing:
        parts.append(f"missing in checkpoint: {head(missing)}")
    if unexpected:
        parts.append(f"unexpected in checkpoint: {head(unexpected)}")
    if shapes:
        parts.append(f"shape mismatch: {head(shapes)}")
    raise ValueError(
        "checkpoint does not match the model (was it saved from another model?) -- " + "; ".join(parts)
    )
