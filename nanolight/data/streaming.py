"""Streaming: each dp rank reads, tokenizes and packs only its own share of a document stream
(`StreamRows`, the rows of the one `PackedLoader`), a source of its own beside the prepared shards.

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
from typing import TYPE_CHECKING, Any

import numpy as np

from nanolight.data.config import BatchGeometry
from nanolight.data.loader import PackedLoader
from nanolight.data.sources import check_text_field, reading
from nanolight.data.tokenizer import Encoder

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

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
        it, before = iter(ds), state
        while True:
            with reading(self.files):  # a damaged file surfaces here
                rows = list(itertools.islice(it, self.batch_size))
            if not rows:
                return
            check_text_field(list(rows[0]), self.text_field)
            after = ds.state_dict()
            texts = [r[self.text_field] for r in rows]
            if self.skip:
                texts = [t for t in texts if not t or digest(t) not in self.skip]
            tokens, _, _ = encoder.documents(texts, self.tokenizer.eos_token_id)
            yield before, tokens, texts, after
            before = after

    def windows(self, cursor: Cursor, size: int) -> Iterator[tuple[np.ndarray, Cursor | None]]:
        """Consecutive `size`-token windows from `cursor`, each with the cursor right after it.

        The last window of the stream may be shorter; its cursor is None (the end)."""
        # (state before, tokens) of the read batches not used up; pending[0]'s first `offset` are used
        pending: list[tuple[dict | None, np.ndarray]] = []
        offset = cursor[1]
        for before, tokens, _, after in self.batches(cursor[0]):
            pending.append((before, tokens))
            while sum(len(t) for _, t in pending) - offset >= size:
                window = np.concatenate([t for _, t in pending])[offset : offset + size]
                offset += size
                while pending and offset >= len(pending[0][1]):
                    offset -= len(pending.pop(0)[1])
                yield window, ((pending[0][0], offset) if pending else (after, 0))
        yield np.concatenate([t for _, t in pending] or [np.zeros(0, dtype=np.int64)])[offset:], None


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


class StreamRows:
    """The rows of this rank's stream share (a `RowSource`): its next blocks, whatever global
    samples the loader asks for, for ever (a finished share starts another pass); resuming
    re-reads at most one window."""

    epoch_samples = None  # a stream has no epochs

    def __init__(
        self,
        dataset: Any,
        tokenizer: PreTrainedTokenizerBase,
        text_field: str,
        geometry: BatchGeometry,
        shuffle_buffer: int = 1024,
        skip_documents: frozenset[str] = frozenset(),
        tokenize_batch_size: int = 256,
        document_eos: int | None = None,
        source_files: list[str] | None = None,
    ) -> None:
        self.document_eos = document_eos
        self.seq_len, self.window_blocks = geometry.seq_len, max(1, shuffle_buffer)
        self.dp_rank, self.dp_size, self.seed = geometry.dp_rank, geometry.dp_size, geometry.seed
        share, files = rank_stream(dataset, self.dp_rank, self.dp_size), source_files or ["the stream"]
        self.stream = DocumentStream(share, tokenizer, text_field, tokenize_batch_size, skip_documents, files)
        self._pass, self._window, self._taken, self._blocks_served = 0, 0, 0, 0
        self._cursor: Cursor = (None, 0)
        self._served: Iterator[np.ndarray] | None = None  # the blocks from the position on

    def _blocks(self) -> Iterator[np.ndarray]:
        """This rank's blocks in served order, forever; the state moves before each block is handed out."""
        t = self.seq_len
        while True:
            served_in_pass = self._window > 0 or self._taken > 0 or self._cursor[0] is not None
            for tokens, after in self.stream.windows(self._cursor, self.window_blocks * t):
                blocks = tokens[: len(tokens) // t * t].reshape(-1, t)
                order = np.arange(len(blocks))
                if self.window_blocks > 1:
                    rng = np.random.default_rng([self.seed, self.dp_rank, self._pass, self._window])
                    order = rng.permutation(len(blocks))
                for i in order[self._taken :]:
                    self._taken += 1
                    self._blocks_served += 1
                    served_in_pass = True
                    if self._taken == len(blocks):  # the window is used up: the position moves past it
                        self._next_window(after)
                    yield blocks[i]
                if len(blocks) == 0:  # the stream's last window, shorter than a block
                    self._next_window(after)
            if not served_in_pass:
                raise ValueError(
                    f"dp rank {self.dp_rank} of {self.dp_size}: its share of the stream holds fewer than "
                    f"seq_len={self.seq_len} tokens (after the validation documents); use a larger corpus, "
                    "a smaller seq_len, fewer data-parallel ranks or a smaller data.val_blocks"
                )
            warnings.warn(
                f"dp rank {self.dp_rank} read its whole share of the stream: pass {self._pass} repeats it "
                "(the stream has no epochs; bound the run with trainer.max_steps)",
                stacklevel=2,
            )

    def _next_window(self, after: Cursor | None) -> None:
        """Move the position past the current window: to `after`, or to the next pass at the end."""
        self._taken = 0
        if after is None:
            self._pass, self._window, self._cursor = self._pass + 1, 0, (None, 0)
        else:
            self._window, self._cursor = self._window + 1, after

    def rows(self, ks: np.ndarray, epoch: int) -> np.ndarray:
        if self._served is None:
            self._served = self._blocks()
        return np.stack([next(self._served) for _ in range(len(ks))]).astype(np.int64)

    def step_starts(self, pos: int, global_batch: int) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        """Plain data (ints, strings, the stream's own nested dict): safe for `torch.load(weights_only=True)`."""
        return {
            "pass": self._pass,
            "window": self._window,
            "window_blocks_served": self._taken,
            "stream_state": self._cursor[0],
            "token_offset": self._cursor[1],
            "blocks_served": self._blocks_served,
            "seed": self.seed,
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "seq_len": self.seq_len,
            "window_size": self.window_blocks,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "stream_state" not in state:
            raise ValueError(
                "this checkpoint's data position comes from a non-streaming loader; resume with the same "
                "data settings (data.streaming, data.path) it was saved with"
            )
        if int(state["dp_size"]) != self.dp_size:
            raise ValueError(
                f"this streaming run was saved at dp={state['dp_size']} and is resumed at dp={self.dp_size}: "
                f"each dp rank reads its own share of the stream, and another dp shares it out otherwise, so "
                f"the position cannot carry over. Resume with dp={state['dp_size']} (+parallel.dp), or train from "
                "prepared data (scripts/prepare_data.py), which resumes at any dp"
            )
        if int(state["dp_rank"]) != self.dp_rank:
            raise ValueError(
                f"dp rank {self.dp_rank} was handed the stream position of dp rank {state['dp_rank']}: a "
                "streaming resume needs each rank's own position, which the checkpoint restores only at the "
                "layout (tp, pp, dp) it was saved with. Resume at that layout"
            )
        for key, mine in (
            ("seed", self.seed),
            ("seq_len", self.seq_len),
            ("window_size", self.window_blocks),
        ):
            if int(state[key]) != mine:
                raise ValueError(
                    f"the checkpoint's stream was read with {key}={state[key]}, this loader has {key}={mine}: "
                    f"resume with the same {'seed' if key == 'seed' else 'trainer.seq_len / data.shuffle_buffer'}"
                )
        self._served = None  # read again from the restored position
        self._pass, self._window = int(state["pass"]), int(state["window"])
        self._taken, self._blocks_served = int(state["window_blocks_served"]), int(state["blocks_served"])
        self._cursor = (state["stream_state"], int(state["token_offset"]))


def StreamingPackedLoader(
    dataset: Any,
    tokenizer: PreTrainedTokenizerBase,
    text_field: str,
    geometry: BatchGeometry,
    **kwargs: Any,
) -> PackedLoader:
    """Micro-batches {"input_ids", "target_ids"} (micro_batch_size, seq_len) of this rank's stream
    share: the packed loader over `StreamRows` (its keyword arguments)."""
    return PackedLoader(StreamRows(dataset, tokenizer, text_field, geometry, **kwargs), geometry)
