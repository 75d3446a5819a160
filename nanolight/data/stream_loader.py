"""`StreamingPackedLoader`: this dp rank's micro-batches from its share of a stream (see streaming.py)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from nanolight.data.docmask import make_batch
from nanolight.data.loader import _check_sizes
from nanolight.data.streaming import Cursor, DocumentStream, rank_stream


class StreamingPackedLoader:
    """Micro-batches {"input_ids", "target_ids"} (micro_batch_size, seq_len) of this rank's stream share.

    Never ends (see streaming.py): a rank that finishes its share starts another pass. The
    state holds the stream's own position, so resuming costs one window whatever the step.
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
        skip_documents: frozenset[str] = frozenset(),
        tokenize_batch_size: int = 256,
        document_eos: int | None = None,
        source_files: list[str] | None = None,
    ) -> None:
        _check_sizes(micro_batch_size, accumulate_grad_batches, dp_rank, dp_size)
        self.stream = DocumentStream(
            rank_stream(dataset, dp_rank, dp_size), tokenizer, text_field, tokenize_batch_size, skip_documents,
            source_files or ["the stream"],
        )  # fmt: skip
        self.seq_len, self.window_blocks = seq_len, max(1, shuffle_buffer)
        self.micro_batch_size, self.accumulate_grad_batches = micro_batch_size, accumulate_grad_batches
        self.dp_rank, self.dp_size, self.seed, self.document_eos = dp_rank, dp_size, seed, document_eos
        self.global_batch_size = micro_batch_size * accumulate_grad_batches * dp_size
        self._pass, self._window, self._taken, self._blocks_served = 0, 0, 0, 0
        self._cursor: Cursor = (None, 0)

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
                        self._window, self._taken = self._window + 1, 0
                        self._cursor = after if after is not None else (None, 0)
                        if after is None:
                            self._pass, self._window = self._pass + 1, 0
                    yield blocks[i]
                if after is None and len(blocks) == 0:
                    self._pass, self._window, self._taken, self._cursor = self._pass + 1, 0, 0, (None, 0)
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

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        blocks = self._blocks()
        while True:
            rows = np.stack([next(blocks) for _ in range(self.micro_batch_size)]).astype(np.int64)
            yield make_batch(torch.from_numpy(rows), self.document_eos)

    def state_dict(self) -> dict[str, Any]:
        """Plain data (ints, strings, the stream's own nested dict): safe for `torch.load(weights_only=True)`."""
        return {
            "samples_consumed": self._blocks_served * self.dp_size,
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
        self._pass, self._window = int(state["pass"]), int(state["window"])
        self._taken, self._blocks_served = int(state["window_blocks_served"]), int(state["blocks_served"])
        self._cursor = (state["stream_state"], int(state["token_offset"]))
