"""Streaming: tokenize and pack on the fly, for corpora too large to tokenize up front.

Every rank reads the whole stream in the same order, packs it into the same blocks, shuffles
them with the same seeded buffer, groups them into global batches of G blocks and keeps only its
own slice -- the same global-batch rule as `PackedLoader`, so a run's step s sees the same
samples whatever the dp size. That costs each rank a full read and tokenization of the stream
(dp-fold redundant work), the price of needing no coordination. Resuming re-streams the epoch
from its start and skips the consumed blocks: it re-tokenizes everything already trained on in
this epoch, so resuming late in a huge epoch takes a while (measure before relying on it).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from nanolight.data.loader import _check_sizes
from nanolight.data.tokens import iter_token_chunks


def stream_blocks(
    dataset: Any, tok: PreTrainedTokenizerBase, text_field: str, seq_len: int, batch_size: int
) -> Iterator[np.ndarray]:
    """Packed (seq_len,) int64 blocks of a document stream; the final partial block is dropped."""
    pending = np.zeros(0, dtype=np.int64)
    for chunk in iter_token_chunks(dataset, tok, text_field, batch_size, num_proc=None):
        pending = np.concatenate([pending, chunk])
        n = len(pending) // seq_len
        yield from pending[: n * seq_len].reshape(n, seq_len)
        pending = pending[n * seq_len :]


def shuffled(blocks: Iterator[np.ndarray], buffer: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """A seeded buffer shuffle: local mixing of a stream at O(buffer) memory, deterministic per seed."""
    if buffer <= 1:
        yield from blocks
        return
    buf: list[np.ndarray] = []
    for block in blocks:
        if len(buf) < buffer:
            buf.append(block)
            continue
        i = int(rng.integers(buffer))
        yield buf[i]
        buf[i] = block
    for i in rng.permutation(len(buf)):
        yield buf[i]


class StreamingPackedLoader:
    """This dp rank's micro-batches from a streamed corpus; resumable by global samples consumed.

    The first `skip_blocks` packed blocks of the stream are the validation split and are never
    trained on. A pass runs to the end of the stream (one epoch) and then moves to the next
    epoch, which re-reads the stream with a different shuffle. The incomplete last global batch
    of an epoch is dropped. There is no `__len__`: a stream's length is unknown; bound training
    with `max_steps`.
    """

    def __init__(
        self,
        dataset: Any,
        tokenizer: PreTrainedTokenizerBase,
        text_field: str,
        seq_len: int,
        micro_batch_size: int,
        accumulate_grad_batches: int = 1,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle_buffer: int = 1024,
        skip_blocks: int = 0,
        tokenize_batch_size: int = 1000,
    ) -> None:
        _check_sizes(micro_batch_size, accumulate_grad_batches, dp_rank, dp_size)
        self.dataset, self.tokenizer, self.text_field = dataset, tokenizer, text_field
        self.seq_len, self.tokenize_batch_size = seq_len, tokenize_batch_size
        self.micro_batch_size, self.accumulate_grad_batches = micro_batch_size, accumulate_grad_batches
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.shuffle_buffer, self.skip_blocks = shuffle_buffer, skip_blocks
        self.global_batch_size = micro_batch_size * accumulate_grad_batches * dp_size
        self._epoch, self._consumed = 0, 0  # global samples (blocks) of completed global batches

    def _global_batches(self, epoch: int) -> Iterator[np.ndarray]:
        blocks = stream_blocks(
            self.dataset, self.tokenizer, self.text_field, self.seq_len, self.tokenize_batch_size
        )
        blocks = itertools.islice(blocks, self.skip_blocks, None)
        blocks = shuffled(blocks, self.shuffle_buffer, np.random.default_rng([self.seed, epoch]))
        while True:
            batch = list(itertools.islice(blocks, self.global_batch_size))
            if len(batch) < self.global_batch_size:
                return
            yield np.stack(batch)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        mbs, acc = self.micro_batch_size, self.accumulate_grad_batches
        per_rank = mbs * acc
        skip_steps = self._consumed // self.global_batch_size
        yielded_any = False
        for step, batch in enumerate(self._global_batches(self._epoch)):
            if step < skip_steps:
                continue  # resume: re-streamed, re-tokenized and discarded
            yielded_any = True
            mine = batch[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
            for j in range(acc):
                ids = torch.from_numpy(np.ascontiguousarray(mine[j * mbs : (j + 1) * mbs]))
                if j + 1 == acc:
                    self._consumed += self.global_batch_size
                yield {"input_ids": ids, "labels": ids.clone()}
        if not yielded_any and skip_steps == 0:
            raise ValueError(
                f"the stream yields fewer than one global batch of {self.global_batch_size} blocks of "
                f"seq_len={self.seq_len} ({self.global_batch_size * self.seq_len} tokens) after the "
                f"{self.skip_blocks} validation blocks; use a larger corpus or smaller batch/seq_len/val_blocks"
            )
        self._epoch, self._consumed = self._epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "samples_consumed": self._consumed, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if int(state["seed"]) != self.seed:
            raise ValueError(
                f"the checkpoint's stream order comes from seed={state['seed']} but this loader has "
                f"seed={self.seed}; resume with the same `seed`"
            )
        self._epoch, self._consumed = int(state["epoch"]), int(state["samples_consumed"])


def take_blocks(
    dataset: Any, tok: PreTrainedTokenizerBase, text_field: str, seq_len: int, n: int, batch_size: int
) -> np.ndarray:
    """The first `n` packed blocks of a stream, flat (for the streaming validation split)."""
    blocks = list(itertools.islice(stream_blocks(dataset, tok, text_field, seq_len, batch_size), n))
    return np.concatenate(blocks) if blocks else np.zeros(0, dtype=np.int64)
