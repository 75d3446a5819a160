"""Weighted mixtures of prepared datasets: a fixed interleaving, resumable in O(1).

Which source global sample k comes from is not drawn at random: the weights are turned into
integer counts n_i over a period of P samples (0.7/0.2/0.1 -> 7/2/1 of every 10), and the
period is laid out greedily (each position goes to the source furthest behind its share), so
every prefix of the stream is within one sample of its share and every window of global
batches within two. Sample k is then (source table[k % P], that source's sample number
(k // P) * n_i + prefix count), a closed form: resuming at sample 10^9 costs what resuming at 0
does. Within a source, samples follow its own seeded permutation, one per pass over it.

Global batch s is mixture samples [s*G, (s+1)*G) and dp rank r takes its contiguous slice, as
for a single dataset, so the global batch is the same at every layout.
"""

from __future__ import annotations

import math
import warnings
from fractions import Fraction
from typing import Any

import numpy as np

from nanolight.data.config import BatchGeometry, DataError
from nanolight.data.loader import PackedDataset, PackedLoader, epoch_order


class MixtureSchedule:
    """Source of every global sample index for `weights` (any positive numbers, relative)."""

    def __init__(self, weights: list[float]) -> None:
        total = sum(weights)
        shares = [Fraction(w / total).limit_denominator(1000) for w in weights]
        period = math.lcm(*(s.denominator for s in shares))
        self.period = min(period, 10_000)  # shares of a large common denominator: apportioned
        self.counts = _apportion([w / total for w in weights], self.period)
        self.table = _interleave(self.counts)
        onehot = np.eye(len(weights), dtype=np.int64)[self.table]
        self.prefix = np.vstack([np.zeros(len(weights), dtype=np.int64), np.cumsum(onehot, axis=0)])
        self.positions = [np.flatnonzero(self.table == i) for i in range(len(weights))]

    def locate(self, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, sample number within that source) of global sample indices `k`."""
        q, r = np.divmod(np.asarray(k, dtype=np.int64), self.period)
        src = self.table[r]
        return src, q * self.counts[src] + self.prefix[r, src]

    def count(self, source: int, k: int) -> int:
        """How many of the first `k` global samples come from `source`."""
        q, r = divmod(k, self.period)
        return q * int(self.counts[source]) + int(self.prefix[r, source])

    def position_of(self, source: int, j: int) -> int:
        """Global index of `source`'s sample number `j` (0-based)."""
        q, rem = divmod(j, int(self.counts[source]))
        return q * self.period + int(self.positions[source][rem])


def _apportion(shares: list[float], total: int) -> np.ndarray:
    """Integer counts summing to `total`, each >= 1, proportional to `shares` (largest remainder)."""
    quotas = np.array(shares) * total
    counts = np.maximum(np.floor(quotas).astype(np.int64), 1)
    while counts.sum() < total:
        counts[int(np.argmax(quotas - counts))] += 1
    while counts.sum() > total:
        counts[int(np.argmax(np.where(counts > 1, counts - quotas, -np.inf)))] -= 1
    return counts


def _interleave(counts: np.ndarray) -> np.ndarray:
    """One period: position p goes to the source furthest behind its share (integer arithmetic)."""
    period, taken = int(counts.sum()), np.zeros(len(counts), dtype=np.int64)
    table = np.empty(period, dtype=np.int64)
    for p in range(period):
        deficit = counts * (p + 1) - taken * period  # share due by p+1 minus taken, times the period
        deficit[taken >= counts] = np.iinfo(np.int64).min
        table[p] = i = int(np.argmax(deficit))  # ties: the lower source index
        taken[i] += 1
    return table


class MixedRows:
    """The rows of several `PackedDataset`s mixed by weight (a `RowSource`): global sample k comes
    from the source and sample number `MixtureSchedule` gives it, each source in its own seeded
    order, one per pass over it.

    `exhausted="repeat"`: a source that runs out starts a new pass in a new order (with a
    warning) and the loader never ends an epoch (bound the run with max_steps). `"stop"`: the
    epoch ends at the last full global batch before any source would repeat; the next epoch
    restarts every source in a new order.
    """

    def __init__(
        self,
        sources: list[PackedDataset],
        weights: list[float],
        names: list[str],
        geometry: BatchGeometry,
        exhausted: str = "repeat",
    ) -> None:
        for name, ds in zip(names, sources, strict=True):
            if ds.seq_len != sources[0].seq_len:
                raise DataError(
                    f"{name} has seq_len={ds.seq_len}, not {sources[0].seq_len}: mix equal lengths"
                )
            if len(ds) == 0:
                raise DataError(f"{name} has no training sample of seq_len={ds.seq_len}: prepare more data")
        self.sources, self.names, self.exhausted = sources, names, exhausted
        self.seq_len, self.document_eos = sources[0].seq_len, sources[0].document_eos
        self.seed, self.dp_rank = geometry.seed, geometry.dp_rank
        self.schedule = MixtureSchedule(weights)
        self._orders: dict[int, tuple[int, np.ndarray]] = {}  # source -> (pass, its sample order)
        self.epoch_samples, g = None, geometry.global_batch_size
        if exhausted == "stop":
            first_repeat = min(self.schedule.position_of(i, len(ds)) for i, ds in enumerate(sources))
            self.epoch_samples = first_repeat // g * g
            if self.epoch_samples == 0:
                raise DataError(
                    f"with data.mixture_exhausted=stop a source runs out before one global batch of "
                    f"{g} samples: prepare more data for the small sources or use repeat"
                )

    def _order(self, source: int, pass_: int) -> np.ndarray:
        cached = self._orders.get(source)
        if cached is None or cached[0] != pass_:
            order = epoch_order(len(self.sources[source]), self.seed, pass_, True, key=(source,))
            self._orders[source] = cached = (pass_, order)
        return cached[1]

    def rows(self, ks: np.ndarray, epoch: int) -> np.ndarray:
        src, local = self.schedule.locate(ks)
        for s in np.unique(src):
            n, mine = len(self.sources[s]), np.flatnonzero(src == s)
            passes = np.full(len(mine), epoch) if self.epoch_samples else local[mine] // n
            for p in np.unique(passes):
                sel = mine[passes == p]
                local[sel] = self._order(int(s), int(p))[local[sel] % n]
        return _gather(self.sources, src, local)

    def step_starts(self, pos: int, global_batch: int) -> None:
        """Under `repeat`, rank 0 warns when this step runs a source out (every rank runs the same schedule)."""
        if self.epoch_samples is not None or self.dp_rank != 0:
            return
        for i, ds in enumerate(self.sources):
            before = self.schedule.count(i, pos) // len(ds)
            after = self.schedule.count(i, pos + global_batch) // len(ds)
            if after > before:
                warnings.warn(
                    f"{self.names[i]} ran out of samples at step {pos // global_batch} (all "
                    f"{len(ds)} served {after} time(s)): repeating it in a new order; set "
                    "data.mixture_exhausted=stop to end the epoch there instead",
                    stacklevel=3,
                )

    def state_dict(self) -> dict[str, Any]:
        return {
            "mixture_counts": [int(c) for c in self.schedule.counts],
            "source_samples": [len(ds) for ds in self.sources],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = (list(state["mixture_counts"]), list(state["source_samples"]))
        now = ([int(c) for c in self.schedule.counts], [len(ds) for ds in self.sources])
        if saved != now:
            raise DataError(
                f"data.mixture differs from the checkpoint's (per-period counts {saved[0]} vs {now[0]}, "
                f"samples per source {saved[1]} vs {now[1]}): its sample position means other samples "
                "now. Resume with the checkpoint's mixture and seq_len"
            )


def MixtureLoader(
    sources: list[PackedDataset],
    weights: list[float],
    names: list[str],
    geometry: BatchGeometry,
    exhausted: str = "repeat",
) -> PackedLoader:
    """This dp rank's micro-batches from several `PackedDataset`s mixed by weight: the packed
    loader over `MixedRows`. `state_dict()` is a consumed-samples counter."""
    return PackedLoader(MixedRows(sources, weights, names, geometry, exhausted), geometry)


class ConcatBlocks:
    """Several datasets end to end, for the mixture's validation split (every source's held-out blocks)."""

    def __init__(self, parts: list[PackedDataset]) -> None:
        self.parts = [p for p in parts if len(p)]
        self.starts = np.cumsum([0] + [len(p) for p in self.parts])
        self.seq_len, self.document_eos = parts[0].seq_len, parts[0].document_eos

    def __len__(self) -> int:
        return int(self.starts[-1])

    def rows(self, indices: np.ndarray) -> np.ndarray:
        indices = np.asarray(indices)
        part = np.searchsorted(self.starts, indices, side="right") - 1
        return _gather(self.parts, part, indices - self.starts[part])


def _gather(sources: list[PackedDataset], which: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The rows whose j-th is row `rows[j]` of `sources[which[j]]`."""
    out = np.empty((len(which), sources[0].seq_len), dtype=np.int64)
    for s in np.unique(which):
        out[which == s] = sources[s].rows(rows[which == s])
    return out
