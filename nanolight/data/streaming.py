"""Streaming: each dp rank reads, tokenizes and packs only its own share of a document stream.

The stream is split with `datasets.distributed.split_dataset_by_node`: rank r reads the files
(or parquet row groups) r, r+dp, ... -- 1/dp of the bytes. Its blocks are served in shuffle
windows: `shuffle_buffer` blocks are read, permuted by (seed, rank, pass, window) and served
in turn. The position is the stream's own `state_dict()` at the start of the read batch where
the current window begins, the token offset into that batch and the blocks already served from
the window, so a resume re-reads at most one window and one read batch, wherever it stopped.

Global batch s is, on every rank, its next micro_batch_size * accumulate_grad_batches blocks:
the same documents at every layout with the same dp. Another dp splits the stream otherwise,
so a resume at another dp is refused (prepared data allows it). A rank that reaches the end of
its share starts another pass over it, with a warning: ranks never wait for each other, so the
loader has no epochs; bound the run with max_steps. The validation blocks are the first blocks
of the whole stream; their documents are skipped in training on every rank.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import itertools
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from nanolight.data.sources import check_text_field, guard_reads
from nanolight.data.tokenize import Encoder

Cursor = tuple[dict | None, int]  # (stream state before a read batch, None = the pass start; token offset)


def digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


@dataclass
class DocumentStream:
    """Documents of a `datasets.IterableDataset` as token batches, resumable at read-batch starts."""

    make_stream: Callable[[], Any]
    tokenizer: PreTrainedTokenizerBase
    text_field: str
    batch_size: int = 256
    skip: frozenset[str] = field(default_factory=frozenset)  # digests of documents not to yield
    files: list[str] = field(default_factory=lambda: ["the stream"])  # named when reading fails

    def batches(self, state: dict | None) -> Iterator[tuple[dict | None, np.ndarray, list[str], dict]]:
        """(state before, tokens with EOS after each document, texts, state after) per read batch."""
        ds = self.make_stream()  # a fresh object: a loaded state would otherwise stick to later passes
        if state is not None:
            ds.load_state_dict(copy.deepcopy(state))
        encoder = Encoder.of(self.tokenizer, self.text_field, np.dtype(np.int64))
        eos, it, before = self.tokenizer.eos_token_id, guard_reads(ds, self.files), state
        while True:
            rows = list(itertools.islice(it, self.batch_size))  # a damaged file surfaces here
            if not rows:
                return
            check_text_field(list(rows[0]), self.text_field)
            after = ds.state_dict()
            texts = [r[self.text_field] for r in rows]
            if self.skip:
                texts = [t for t in texts if not t or digest(t) not in self.skip]
            ids, keep = encoder.encode(texts)
            docs = [np.append(x, eos) for x, k in zip(ids, keep, strict=True) if k]
            yield before, (np.concatenate(docs) if docs else np.zeros(0, dtype=np.int64)), texts, after
            before = after

    def windows(self, cursor: Cursor, size: int) -> Iterator[tuple[np.ndarray, Cursor | None]]:
        """Consecutive `size`-token windows from `cursor`, each with the cursor right after it.

        The last window of the stream may be shorter; its cursor is None (the end)."""
        pending: list[list[Any]] = []  # [state before, tokens, offset already used]
        have, last_after = 0, cursor[0]
        for i, (before, tokens, _, after) in enumerate(self.batches(cursor[0])):
            offset = cursor[1] if i == 0 else 0
            pending.append([before, tokens, offset])
            have, last_after = have + len(tokens) - offset, after
            while have >= size:
                yield _take(pending, size), ((pending[0][0], pending[0][2]) if pending else (last_after, 0))
                have -= size
        yield _take(pending, have), None


def _take(pending: list[list[Any]], n: int) -> np.ndarray:
    """The next `n` tokens of `pending`, which is advanced past them."""
    parts = []
    while n > 0:
        _, tokens, offset = pending[0]
        k = min(n, len(tokens) - offset)
        parts.append(tokens[offset : offset + k])
        n -= k
        pending[0][2] += k
        if pending[0][2] == len(tokens):
            pending.pop(0)
    while pending and pending[0][2] == len(pending[0][1]):
        pending.pop(0)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def rank_stream(dataset: Any, dp_rank: int, dp_size: int) -> Callable[[], Any]:
    """A factory of this rank's share of `dataset`: whole shards when there are >= dp of them."""
    if dp_size == 1:
        return lambda: dataset
    from datasets.distributed import split_dataset_by_node

    if dataset.num_shards % dp_size and hasattr(dataset, "reshard"):
        dataset = dataset.reshard()  # parquet: one shard per row group, to share them out evenly
    if dataset.num_shards >= dp_size:
        strategy = "shards"
    else:
        strategy = "examples"
        warnings.warn(
            f"the stream has {dataset.num_shards} shard(s) (files or parquet row groups) for dp={dp_size}: "
            "every rank reads all of it and keeps 1/dp of the documents. Split the corpus into >= dp files",
            stacklevel=3,
        )
    if "strategy" not in inspect.signature(split_dataset_by_node).parameters:  # datasets < 4: "auto" only
        return lambda: split_dataset_by_node(dataset, dp_rank, dp_size)
    return lambda: split_dataset_by_node(dataset, dp_rank, dp_size, strategy=strategy)


@dataclass
class HeldOut:
    """The validation split of a stream: its first blocks, and the documents they came from."""

    tokens: np.ndarray
    documents: frozenset[str]


def hold_out(
    dataset: Any,
    tokenizer: PreTrainedTokenizerBase,
    text_field: str,
    seq_len: int,
    n_blocks: int,
    batch_size: int,
) -> HeldOut:
    """The first `n_blocks` packed blocks of the whole stream (every rank reads the same few documents)."""
    if n_blocks == 0:
        return HeldOut(np.zeros(0, dtype=np.int64), frozenset())
    parts, have, docs = [], 0, set()
    stream = DocumentStream(lambda: dataset, tokenizer, text_field, min(batch_size, 64))
    for _, tokens, texts, _ in stream.batches(None):
        parts.append(tokens)
        have += len(tokens)
        docs.update(digest(t) for t in texts if t)
        if have >= n_blocks * seq_len:
            break
    flat = np.concatenate(parts)[: n_blocks * seq_len]
    return HeldOut(flat[: len(flat) // seq_len * seq_len], frozenset(docs))
