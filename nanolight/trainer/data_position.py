"""Where training stands in its data: iteration that can resume mid-epoch, and what a step consumed.

Two kinds of loaders:

* loaders with ``state_dict()/load_state_dict()`` (the nanolight data loader) are restored
  through those and simply continue;
* plain ``DataLoader``s are resumed by re-creating the epoch's iterator *with the same RNG
  state it was created with* (a shuffled ``RandomSampler`` draws its permutation seed from the
  global torch generator, or from the loader's/sampler's own generator, when the iterator is
  created) and skipping the micro-batches already consumed.

The trainer's RNG states at checkpoint time are restored *after* the skip, so the run continues
exactly as an uninterrupted one would.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch


def is_stateful(loader: Any) -> bool:
    return callable(getattr(loader, "state_dict", None)) and callable(
        getattr(loader, "load_state_dict", None)
    )


def _generators(loader: Any) -> list[torch.Generator | None]:
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    inner = getattr(batch_sampler, "sampler", None)
    return [
        getattr(loader, "generator", None),
        getattr(sampler, "generator", None),
        getattr(inner, "generator", None) if inner is not sampler else None,
    ]


def capture_epoch_start(loader: Any) -> dict[str, Any]:
    """RNG state that decides this epoch's sample order (before ``iter(loader)``)."""
    gens = [g.get_state() if g is not None else None for g in _generators(loader)]
    return {"torch": torch.get_rng_state(), "generators": gens}


def restore_epoch_start(loader: Any, state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    for gen, saved in zip(_generators(loader), state["generators"], strict=False):
        if gen is not None and saved is not None:
            gen.set_state(saved)


def set_epoch(loader: Any, epoch: int) -> None:
    """DistributedSampler-style samplers reshuffle per epoch through ``set_epoch``."""
    for obj in (getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)):
        if callable(getattr(obj, "set_epoch", None)):
            obj.set_epoch(epoch)


def take(iterator: Iterator, n: int) -> list[Any]:
    """Up to ``n`` items (fewer at the end of the epoch)."""
    out = []
    for _ in range(n):
        try:
            out.append(next(iterator))
        except StopIteration:
            break
    return out


def skip(iterator: Iterator, n: int) -> None:
    for _ in range(n):
        next(iterator)


def count_samples_tokens(batch: Any) -> tuple[int, int]:
    """(samples, tokens) of a micro-batch: tokens = numel of ``input_ids`` when present."""
    if isinstance(batch, dict) and isinstance(batch.get("input_ids"), torch.Tensor):
        ids = batch["input_ids"]
        return int(ids.shape[0]), int(ids.numel())
    first = batch
    while isinstance(first, (list, tuple, dict)) and len(first) > 0:
        first = next(iter(first.values())) if isinstance(first, dict) else first[0]
    if isinstance(first, torch.Tensor) and first.ndim > 0:
        return int(first.shape[0]), 0
    return 0, 0


def count_consumed(progress: dict[str, int], batches: list[Any], dp_size: int) -> None:
    """Add one step's samples/tokens, global over data-parallel replicas, to ``progress``."""
    for b in batches:
        samples, tokens = count_samples_tokens(b)
        progress["samples"] += samples * dp_size
        progress["tokens"] += tokens * dp_size


def loader_len(loader: Iterable) -> int | None:
    try:
        return len(loader)  # type: ignore[arg-type]
    except TypeError:
        return None
