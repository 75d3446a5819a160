"""Packed blocks and the one loader that serves them: dp-sharded, resumable, the same global batch
at every layout.

Packing concatenates every document (each followed by EOS) and cuts the stream into blocks of
exactly `seq_len` tokens, so no compute is spent on padding; a block may span document
boundaries, and the EOS tells the model where one document ends. The last `num_tokens % seq_len`
tokens do not fill a block and are dropped (at most seq_len - 1 tokens of the whole corpus).

The rule (DESIGN.md) that makes runs comparable across layouts: an epoch's sample order is a
permutation from (seed, epoch); global batch s is order[s*G:(s+1)*G], G = micro_batch_size x
accumulate_grad_batches x dp, and dp rank r takes the r-th contiguous slice of it
(`BatchGeometry.rank_offset`), yielded as `accumulate_grad_batches` micro-batches. Concatenating all ranks' micro-batches of a step, rank-major, gives the same
ordered global batch at any dp size and any micro-batch split. The last `len(dataset) % G`
samples of an epoch (an incomplete global batch) are dropped; the next epoch's permutation
brings them back in.

With `data.document_mask=true` every batch also carries, per token,

    position_ids   0, 1, 2, ... restarting at 0 on the token after each EOS (and at the row start)
    document_ids   0 for the row's first (possibly partial) document, +1 after each EOS

so the model can build a block-diagonal causal mask (tokens attend only within their document
id), and rotary positions start afresh per document. Both are computed from the row alone:
nothing crosses a row, and the EOS belongs to the document it ends. The batch also carries
flash-attn's variable-length offsets of its documents, `cu_seqlens` and `max_seqlen`
(`models/attention.py` `varlen_offsets`), made here on the host: derived from the ids on a GPU
they would read the device back (`nonzero`, the longest length) in every forward.
The next-token targets are made here too, while the row is whole (`make_batch`): a rank that
holds a piece of it (context parallelism) could not shift its own, and counting a step's valid
targets before its micro-batches run needs them (`parallel/loss_tokens.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np
import torch

from nanolight.data.config import BatchGeometry, DataError
from nanolight.models.attention import varlen_offsets
from nanolight.models.llama import shift_labels

_VAL_SEED = 0x5EED  # the held-out blocks do not depend on the training seed: val loss stays comparable


def document_fields(input_ids: torch.Tensor, eos_id: int) -> dict[str, Any]:
    """{"position_ids", "document_ids"} (int64, shape of `input_ids` (B, T)) for packed rows, and
    their documents' {"cu_seqlens", "max_seqlen"}: the model's keyword arguments."""
    is_eos = (input_ids == eos_id).to(torch.int64)
    # a document starts after each EOS: the count of EOS strictly before a token is its document
    document_ids = torch.cumsum(is_eos, dim=-1) - is_eos
    t = input_ids.shape[-1]
    arange = torch.arange(t, dtype=torch.int64).expand_as(input_ids)
    # position = index - index of the document's first token; first tokens are where the id changes
    starts = torch.zeros_like(document_ids, dtype=torch.bool)
    starts[..., 0] = True
    starts[..., 1:] = document_ids[..., 1:] != document_ids[..., :-1]
    first = torch.cummax(torch.where(starts, arange, torch.zeros_like(arange)), dim=-1).values
    cu_seqlens, max_seqlen = varlen_offsets(document_ids)
    return {
        "position_ids": arange - first, "document_ids": document_ids,
        "cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen,
    }  # fmt: skip


def make_batch(ids: torch.Tensor, document_eos: int | None) -> dict[str, Any]:
    """The loaders' batch dict: input_ids and `target_ids` -- the next token, -100 at the row's last
    position and, with document fields, at each document's last token (`shift_labels`)."""
    if document_eos is None:
        return {"input_ids": ids, "target_ids": shift_labels(ids)}
    fields = document_fields(ids, document_eos)
    return {"input_ids": ids, "target_ids": shift_labels(ids, fields["document_ids"]), **fields}


def split_blocks(
    n_blocks: int, val_fraction: float, val_blocks: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) block ids: a fixed pseudo-random `val_fraction` (or `val_blocks`) held out.

    Random rather than the tail: a sorted corpus's tail is one topic (e.g. the stdlib's `xml` and
    `zoneinfo`), a biased validation set. A positive `val_fraction` holds out at least one block;
    the held-out set for a larger count is a superset. The split depends on the data alone, never
    on the layout (a layout-dependent minimum, such as one validation batch of micro_batch_size *
    dp, would change the training samples with dp): a split too small for one validation batch is
    the validation loader's error to report.
    """
    if val_blocks is None:
        val_blocks = max(int(round(val_fraction * n_blocks)), 1 if val_fraction > 0 else 0)
    n_val = min(val_blocks, n_blocks)
    perm = np.random.default_rng(_VAL_SEED).permutation(n_blocks)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool, key: tuple[int, ...] = ()) -> np.ndarray:
    """Sample order of one epoch: a permutation seeded by (seed, *key, epoch), identical on every rank.

    Shuffled in uint32 when it fits (the same permutation as `rng.permutation(n)`, half the
    memory: 4 bytes per sample, 2 GB for a trillion tokens at seq_len 2048).
    """
    order = np.arange(n, dtype=np.uint32 if n < 2**32 else np.int64)
    if shuffle:
        np.random.default_rng([seed, *key, epoch]).shuffle(order)
    return order


class TokenArray(Protocol):
    """A flat token sequence: prepared shards (`TokenShards`) or, in tests, an array."""

    def __len__(self) -> int: ...
    def __getitem__(self, item: slice) -> np.ndarray: ...


class PackedDataset(torch.utils.data.Dataset):
    """Blocks of `seq_len` tokens from a flat token array, restricted to `block_ids`.

    Item i is {"input_ids": (T,), "target_ids": (T,)} int64, target t the token t+1 (-100 at the
    block's last position), so no block overlaps the next. Block b is tokens [b*T, (b+1)*T):
    reading a batch touches only its blocks' bytes. With `document_eos` (the EOS id) items also
    carry `position_ids` and `document_ids`.
    """

    def __init__(
        self,
        tokens: TokenArray,
        seq_len: int,
        block_ids: np.ndarray | None = None,
        document_eos: int | None = None,
    ) -> None:
        if seq_len < 1:
            raise DataError(f"seq_len must be >= 1, got {seq_len}")
        n_blocks = len(tokens) // seq_len
        self.tokens, self.seq_len, self.document_eos = tokens, seq_len, document_eos
        self.block_ids = np.arange(n_blocks) if block_ids is None else np.asarray(block_ids, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.block_ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        batch = self.batch(np.array([i]))  # an item: its per-token fields (offsets are a batch's)
        return {k: v[0] for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() == 2}

    def rows(self, indices: np.ndarray) -> np.ndarray:
        """(len(indices), seq_len) int64 token rows of dataset positions `indices`."""
        t = self.seq_len
        if isinstance(self.tokens, np.ndarray):  # one fancy-index read of a reshaped view
            n = len(self.tokens) // t
            return self.tokens[: n * t].reshape(n, t)[self.block_ids[indices]].astype(np.int64)
        out = np.empty((len(indices), t), dtype=np.int64)
        for row, b in enumerate(self.block_ids[indices]):
            out[row] = self.tokens[int(b) * t : (int(b) + 1) * t]
        return out

    def batch(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        """Stacked items `indices` (positions in this dataset)."""
        return make_batch(torch.from_numpy(self.rows(np.asarray(indices))), self.document_eos)


class RowSource(Protocol):
    """Where the token rows of a packed loader come from: prepared shards (`DatasetRows`), a
    mixture of them (`mixture.MixedRows`) or a stream (`streaming.StreamRows`). Everything else --
    the global batch rule, micro-batches, targets and document fields, the resumable position --
    is the one `PackedLoader`'s."""

    seq_len: int
    document_eos: int | None
    epoch_samples: int | None  # global samples per epoch; None: no epochs (the loader never ends)

    def rows(self, ks: np.ndarray, epoch: int) -> np.ndarray:
        """(len(ks), seq_len) int64 rows of this epoch's global samples `ks` (this rank's slice)."""
        ...

    def step_starts(self, pos: int, global_batch: int) -> None:
        """Before the first micro-batch of the step starting at global sample `pos`."""
        ...

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class DatasetRows:
    """A `PackedDataset`'s rows, in an order seeded by (seed, epoch), or in order (`shuffle` off)."""

    def __init__(self, dataset: PackedDataset, seed: int, shuffle: bool = True) -> None:
        self.dataset, self.seed, self.shuffle = dataset, seed, shuffle
        self.seq_len, self.document_eos, self.epoch_samples = (
            dataset.seq_len,
            dataset.document_eos,
            len(dataset),
        )
        self._epoch_order: tuple[int, np.ndarray] | None = None  # (epoch, its sample order)

    def rows(self, ks: np.ndarray, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return self.dataset.rows(ks)
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            self._epoch_order = (epoch, epoch_order(len(self.dataset), self.seed, epoch, True))
        return self.dataset.rows(self._epoch_order[1][ks])

    def step_starts(self, pos: int, global_batch: int) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class PackedLoader:
    """Yields this dp rank's micro-batches {"input_ids", "target_ids"}: (micro_batch_size, seq_len) int64,
    from `source` (a `RowSource`, or a `PackedDataset`, read through `DatasetRows`).

    Iterating runs the rest of the current epoch, then advances to the next one (a new
    permutation), so the trainer's `for batch in loader` loop sees one epoch per pass and a
    resumed loader continues mid-epoch. `state_dict()` counts global samples consumed, so a run
    can resume at a different dp size or micro-batch split as long as it stopped at a step boundary.
    `restart`: every pass starts at the epoch's beginning (evaluation: `EvalLoader`).
    """

    def __init__(
        self,
        source: RowSource | PackedDataset,
        geometry: BatchGeometry,
        shuffle: bool = True,
        restart: bool = False,
    ) -> None:
        if isinstance(source, PackedDataset):
            source = DatasetRows(source, geometry.seed, shuffle)
        self.source, self.geometry, self.seed, self.restart = source, geometry, geometry.seed, restart
        self.epoch_samples = source.epoch_samples
        self.accumulate_grad_batches = geometry.accumulate_grad_batches
        self.global_batch_size = g = geometry.global_batch_size
        self._epoch = 0
        self._pos = 0  # global samples of completed global batches in this epoch
        self._micro = 0  # micro-batches of the current step this rank has yielded
        n = self.epoch_samples
        if n is not None and n < g and not restart:
            t, mbs, acc = source.seq_len, geometry.micro_batch_size, self.accumulate_grad_batches
            raise DataError(
                f"the training split has {n} blocks of seq_len={t} ({n * t} tokens) but "
                f"one global batch needs {g} blocks (micro_batch_size={mbs} x accumulate_grad_batches={acc} x "
                f"dp={geometry.dp_size}) = {g * t} tokens. Use more data, or lower micro_batch_size, "
                "accumulate_grad_batches, seq_len or data.val_fraction"
            )

    @property
    def steps_per_epoch(self) -> int:
        if self.epoch_samples is None:
            raise TypeError("this loader has no epoch length (a stream, or a mixture that repeats)")
        return self.epoch_samples // self.global_batch_size

    def __len__(self) -> int:
        """Micro-batches per epoch on this rank (a full epoch, from its start)."""
        return self.steps_per_epoch * self.accumulate_grad_batches

    @property
    def epoch(self) -> int:
        return self._epoch

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if self.restart:
            self._epoch, self._pos, self._micro = 0, 0, 0
        mbs, g = self.geometry.micro_batch_size, self.global_batch_size
        while self.epoch_samples is None or self._pos + g <= self.epoch_samples:
            if self._micro == 0:
                self.source.step_starts(self._pos, g)
            start = self._pos + self.geometry.rank_offset(self._micro)
            rows = self.source.rows(np.arange(start, start + mbs), self._epoch)
            # advance the state before yielding: state_dict() right after this batch must count it
            if self._micro + 1 == self.accumulate_grad_batches:
                self._pos, self._micro = self._pos + g, 0
            else:
                self._micro += 1
            yield make_batch(torch.from_numpy(rows), self.source.document_eos)
        # Only a pass that runs to its end moves to the next epoch. A loader saved right after the
        # last step of an epoch therefore resumes with an empty pass that closes that epoch, in
        # step with a trainer that counts epochs by passes.
        self._epoch, self._pos, self._micro = self._epoch + 1, 0, 0

    def state_dict(self) -> dict[str, Any]:
        """Plain data (safe for `torch.load(weights_only=True)`): where the next micro-batch comes
        from, and the source's own position and identity."""
        return {
            "epoch": self._epoch,
            "samples_consumed": self._pos,
            "micro_batches_in_step": self._micro,
            "seed": self.seed,
            **self.source.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the next unseen micro-batch of the run that saved `state`."""
        self.source.load_state_dict(state)
        if int(state["seed"]) != self.seed:
            raise DataError(
                f"the checkpoint's data order comes from seed={state['seed']} but this loader has "
                f"seed={self.seed}; resume with the same `seed` to continue the same sample order"
            )
        micro = int(state.get("micro_batches_in_step", 0))
        if micro >= self.accumulate_grad_batches:
            raise DataError(
                f"the checkpoint stopped after micro-batch {micro} of a step but accumulate_grad_batches="
                f"{self.accumulate_grad_batches}; resume mid-step only with the same layout"
            )
        self._epoch, self._pos = int(state.get("epoch", 0)), int(state["samples_consumed"])
        self._micro = micro


def EvalLoader(dataset: PackedDataset | Any, geometry: BatchGeometry) -> PackedLoader:
    """Validation micro-batches of this dp rank, in fixed order, restarting at every pass: the
    packed loader at one micro-batch per step. Each pass covers floor(len / (micro_batch_size * dp))
    micro-batches per rank, the same count on every rank (ranks run the same number of
    collectives); the few leftover blocks are skipped. `dataset`: a `PackedDataset` or anything with
    `len`, `seq_len`, `document_eos` and `rows(indices)` (a mixture's held-out blocks)."""
    one = dataclasses.replace(geometry, accumulate_grad_batches=1)
    rows = DatasetRows(dataset, geometry.seed, shuffle=False)
    return PackedLoader(rows, one, restart=True)


def eval_loader(val: PackedDataset | Any, geometry: BatchGeometry) -> PackedLoader | None:
    """The validation loader, None without held-out blocks; fewer than one batch is an error."""
    if len(val) == 0:
        return None
    mbs, dp = geometry.micro_batch_size, geometry.dp_size
    if len(val) < mbs * dp:
        raise DataError(
            f"the validation split has {len(val)} blocks, fewer than one validation batch "
            f"(micro_batch_size={mbs} x dp={dp}); raise data.val_fraction / data.val_blocks, "
            "or set data.val_fraction=0 for no validation"
        )
    return EvalLoader(val, geometry)
