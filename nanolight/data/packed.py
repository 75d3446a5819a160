"""Packed blocks: the token file cut into fixed `seq_len` blocks, split into train and validation.

Packing concatenates every document (each followed by EOS) and cuts the stream into blocks of
exactly `seq_len` tokens, so no compute is spent on padding; a block may span document
boundaries, and the EOS tells the model where one document ends. The last `num_tokens % seq_len`
tokens do not fill a block and are dropped (at most seq_len - 1 tokens of the whole corpus).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from nanolight.data.docmask import make_batch

_VAL_SEED = 0x5EED  # the held-out blocks do not depend on the training seed: val loss stays comparable


def split_blocks(
    n_blocks: int, val_fraction: float, val_blocks: int | None = None, min_val_blocks: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) block ids: a fixed pseudo-random `val_fraction` (or `val_blocks`) held out.

    Random rather than the tail: a sorted corpus's tail is one topic (e.g. the stdlib's `xml` and
    `zoneinfo`), a biased validation set. A positive `val_fraction` holds out at least
    `min_val_blocks`; the held-out set for a larger count is a superset. The split depends on the
    data alone, never on the layout (a layout-dependent minimum, such as one validation batch of
    micro_batch_size * dp, would change the training samples with dp): a split too small for one
    validation batch is the validation loader's error to report.
    """
    n_val = val_blocks if val_blocks is not None else int(round(val_fraction * n_blocks))
    if val_fraction > 0 and val_blocks is None:
        n_val = max(n_val, min_val_blocks)
    n_val = min(n_val, n_blocks)
    perm = np.random.default_rng(_VAL_SEED).permutation(n_blocks)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


class TokenArray(Protocol):
    """A flat token sequence: a memory-mapped token file or the prepared shards (`TokenShards`)."""

    def __len__(self) -> int: ...
    def __getitem__(self, item: slice) -> np.ndarray: ...


class PackedDataset(torch.utils.data.Dataset):
    """Blocks of `seq_len` tokens from a flat token array, restricted to `block_ids`.

    Item i is {"input_ids": (T,), "target_ids": (T,)} int64, target t the token t+1 (-100 at the
    block's last position: see docmask.py), so no block overlaps the next. Block b is
    tokens [b*T, (b+1)*T): reading a batch touches only its blocks' bytes. With `document_eos`
    (the EOS id) items also carry `position_ids` and `document_ids` (see docmask.py).
    """

    def __init__(
        self,
        tokens: TokenArray,
        seq_len: int,
        block_ids: np.ndarray | None = None,
        document_eos: int | None = None,
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        n_blocks = len(tokens) // seq_len
        self.tokens, self.seq_len, self.document_eos = tokens, seq_len, document_eos
        self.block_ids = np.arange(n_blocks) if block_ids is None else np.asarray(block_ids, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.block_ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        batch = self.batch(np.array([i]))
        return {k: v[0] for k, v in batch.items()}

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
