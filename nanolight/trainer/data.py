"""Where a trainer call's data comes from and how much of it each loop runs (Lightning's data
connector).

Sources, in Lightning's precedence: loaders passed to the call, then the DataModule, then the
module's own ``*_dataloader`` hooks. A loader is requested when its loop first needs it (the
hook order Lightning has). Under data parallelism a plain ``DataLoader`` gets a
``DistributedSampler`` (each rank its 1/dp of the samples; ``use_distributed_sampler=False`` to
shard yourself); with ``seed_everything(workers=True)`` each worker is seeded. Batch limits
(``limit_*_batches``, ``overfit_batches``, ``num_sanity_val_steps``) follow Lightning. Also
what a step's batches count (samples, tokens) and a loader's epoch (``set_epoch``).
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable, Iterable
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from lightning_utilities.core.overrides import is_overridden
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

from nanolight.errors import UsageError
from nanolight.module import NanoDataModule
from nanolight.module.module import NanoModule

if TYPE_CHECKING:
    from nanolight.trainer.trainer import NanoTrainer


def worker_init(worker_id: int, rank: int = 0) -> None:
    """Distinct, reproducible seeds per dataloader worker and global rank
    (``seed_everything(workers=True)``)."""
    base = int(os.environ.get("PL_GLOBAL_SEED", 0))
    seed = (base + 1000003 * rank + 7919 * worker_id) % 2**32
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def parse_num_batches(kind: str, length: int | None, limit: int | float) -> int | float:
    """Batches a loop runs for a loader of `length` (None: unsized) under `limit`: an int, or
    ``math.inf`` for an unsized loader without an int limit (Lightning's ``num_*_batches``)."""
    if isinstance(limit, int):
        return limit if length is None else min(length, limit)
    if length is None:
        if limit not in (0.0, 1.0):
            raise UsageError(
                f"limit_{kind}_batches={limit}: a fraction needs a loader with a length; give an int"
            )
        return 0 if limit == 0.0 else math.inf
    n = int(length * limit)
    if n == 0 and limit > 0.0 and length > 0:
        raise UsageError(
            f"limit_{kind}_batches={limit} x {length} batches = 0 batches: use at least {1 / length:.3g} or an int"
        )
    return n


class DataConnector:
    """One trainer call's data sources (set by `attach`)."""

    def __init__(self, trainer: NanoTrainer) -> None:
        self.trainer = trainer
        self.datamodule: NanoDataModule | None = None
        self._given: dict[str, Any] = {}

    def attach(self, module: Any, datamodule: Any, **loaders: Any) -> None:
        given = {k: v for k, v in loaders.items() if v is not None}
        if datamodule is not None and not isinstance(datamodule, NanoDataModule):
            raise UsageError(f"datamodule must be a NanoDataModule, got {type(datamodule).__name__}")
        if datamodule is not None and given:
            raise UsageError(f"pass either dataloaders ({', '.join(given)}) or datamodule=..., not both")
        self.module, self.datamodule, self._given = module, datamodule, given
        if datamodule is not None:
            datamodule.trainer = self.trainer

    def _source(self, kind: str) -> Callable[[], Any] | None:
        """Where `kind`'s loaders come from, in Lightning's precedence (None: nowhere)."""
        hook, dm, hooks = f"{kind}_dataloader", self.datamodule, self.trainer.hooks
        if kind in self._given:
            return lambda: self._given[kind]
        if dm is not None and is_overridden(hook, dm, NanoDataModule):
            return lambda: hooks.datamodule(hook)
        if self.module is not None and is_overridden(hook, self.module, NanoModule):
            return lambda: hooks.module(hook)
        return None

    def has_source(self, kind: str) -> bool:
        return self._source(kind) is not None

    def request(self, kind: str) -> list[Any]:
        """The loaders of `kind` (one per dataloader), processed for this run."""
        source = self._source(kind)
        if source is None:
            raise UsageError(
                f"no {kind} data: pass {kind}_dataloaders=... (or a datamodule), or implement {kind}_dataloader()"
            )
        raw = source()
        self.trainer.strategy.barrier(f"{kind}_dataloader()")  # every rank: all have built their loaders
        if isinstance(raw, dict):
            raise UsageError(f"a dict of {kind} dataloaders is not supported: pass one loader or a list")
        loaders = list(raw) if _is_loader_list(raw) else [raw]
        if kind == "train" and len(loaders) != 1:
            raise UsageError(f"training takes one dataloader, got {len(loaders)}: combine them into one")
        return [self._process(loader, kind) for loader in loaders]

    def num_batches(self, loader: Any, kind: str) -> int | float:
        return parse_num_batches(
            kind, loader_len(loader), getattr(self.trainer.config, f"limit_{kind}_batches")
        )

    def _process(self, loader: Any, kind: str) -> Any:
        trainer = self.trainer
        if not isinstance(loader, DataLoader):
            return loader  # a custom iterable (e.g. nanolight's token loaders) shards itself
        if (
            os.environ.get("PL_SEED_WORKERS") == "1"
            and loader.num_workers > 0
            and loader.worker_init_fn is None
        ):
            # settable after construction, unlike the sampler
            loader.worker_init_fn = partial(worker_init, rank=trainer.global_rank)
        kwargs = trainer.strategy.distributed_sampler_kwargs
        sampler = loader.sampler
        shard = (
            kwargs is not None
            and trainer.use_distributed_sampler
            and not isinstance(sampler, DistributedSampler)  # sharded already
            and not isinstance(loader.dataset, IterableDataset)  # nothing a sampler can split
        )
        overfit = (  # Lightning overfits the training and the fit-time validation loaders alike
            kind in ("train", "val")
            and trainer.config.overfit_batches > 0
            and isinstance(sampler, RandomSampler)
        )
        if not (shard or overfit):
            return loader
        if overfit:
            rank_zero_warn(
                f"overfit_batches: the {kind} loader's shuffling is turned off (the same batches each epoch)"
            )
            sampler = SequentialSampler(loader.dataset)
        if shard:
            if type(loader) is not DataLoader or loader.batch_size is None:
                what = type(loader).__name__ if type(loader) is not DataLoader else "a custom batch_sampler"
                raise UsageError(
                    f"cannot shard {what} over data-parallel ranks with a DistributedSampler: pass "
                    "NanoTrainer(use_distributed_sampler=False) and shard the data per rank yourself"
                )
            seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
            sampler = DistributedSampler(
                loader.dataset, shuffle=isinstance(sampler, RandomSampler), seed=seed, **kwargs
            )
        return _rebuild(loader, sampler)


def _is_loader_list(raw: Any) -> bool:
    """A list of dataloaders (one per dataloader_idx), not a list of batches used as one loader."""
    if not isinstance(raw, (list, tuple)) or not raw:
        return False
    return all(
        isinstance(x, DataLoader)
        or (hasattr(x, "__iter__") and not isinstance(x, (torch.Tensor, dict, list, tuple, str)))
        for x in raw
    )


def _rebuild(loader: DataLoader, sampler: Any) -> DataLoader:
    """The same loader with another sampler."""
    names = ["batch_size", "num_workers", "collate_fn", "pin_memory", "drop_last", "timeout"]
    names += ["worker_init_fn", "multiprocessing_context", "generator"]
    if loader.num_workers > 0:
        names += ["prefetch_factor", "persistent_workers"]
    return DataLoader(loader.dataset, sampler=sampler, **{name: getattr(loader, name) for name in names})


def set_epoch(loader: Any, epoch: int) -> None:
    """DistributedSampler-style samplers reshuffle per epoch through ``set_epoch``."""
    for obj in (getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)):
        if callable(getattr(obj, "set_epoch", None)):
            obj.set_epoch(epoch)


def count_consumed(progress: dict[str, int], batches: list[Any], dp_size: int) -> None:
    """Add one step's samples and tokens (``input_ids.numel()`` when there are ``input_ids``),
    global over data-parallel replicas, to ``progress``."""
    for batch in batches:
        if isinstance(batch, dict) and isinstance(batch.get("input_ids"), torch.Tensor):
            progress["samples"] += batch["input_ids"].shape[0] * dp_size
            progress["tokens"] += batch["input_ids"].numel() * dp_size
            continue
        first = batch
        while isinstance(first, (list, tuple, dict)) and len(first) > 0:
            first = next(iter(first.values())) if isinstance(first, dict) else first[0]
        if isinstance(first, torch.Tensor) and first.ndim > 0:
            progress["samples"] += first.shape[0] * dp_size


def loader_len(loader: Iterable) -> int | None:
    try:
        return len(loader)  # type: ignore[arg-type]
    except TypeError:
        return None
