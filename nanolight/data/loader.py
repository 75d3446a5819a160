"""Data-parallel, resumable loaders over a `PackedDataset`.

The rule (CONTRACTS.md) that makes runs comparable across layouts: an epoch's sample order is a
permutation from (seed, epoch); global batch s is order[s*G:(s+1)*G] with
G = micro_batch_size * accumulate_grad_batches * dp_size; dp rank r takes the r-th contiguous
slice of G and yields it as `accumulate_grad_batches` micro-batches. Concatenating all ranks'
micro-batches of a step, rank-major, gives the same ordered global batch at any dp size and any
micro-batch split. The last `len(dataset) % G` samples of an epoch (an incomplete global batch)
are dropped; the next epoch's permutation brings them back in.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from nanolight.data.packed import PackedDataset


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool, key: tuple[int, ...] = ()) -> np.ndarray:
    """Sample order of one epoch: a permutation seeded by (seed, *key, epoch), identical on every rank.

    Shuffled in uint32 when it fits (the same permutation as `rng.permutation(n)`, half the
    memory: 4 bytes per sample, 2 GB for a trillion tokens at seq_len 2048).
    """
    order = np.arange(n, dtype=np.uint32 if n < 2**32 else np.int64)
    if shuffle:
        np.random.default_rng([seed, *key, epoch]).shuffle(order)
    return order


def _check_sizes(micro_batch_size: int, accumulate_grad_batches: int, dp_rank: int, dp_size: int) -> None:
    if micro_batch_size < 1 or accumulate_grad_batches < 1:
        raise ValueError("micro_batch_size and accumulate_grad_batches must be >= 1")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")


class PackedLoader:
    """Yields this dp rank's micro-batches {"input_ids", "target_ids"}: (micro_batch_size, seq_len) int64.

    Iterating runs the rest of the current epoch, then advances to the next one (a new
    permutation), so the trainer's `for batch in loader` loop sees one epoch per pass and a
    resumed loader continues mid-epoch. `state_dict()` counts global samples consumed, so a run
    can resume at a different dp size or micro-batch split as long as it stopped at a step boundary.
    """

    def __init__(
        self,
        dataset: PackedDataset,
        micro_batch_size: int,
        accumulate_grad_batches: int = 1,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        _check_sizes(micro_batch_size, accumulate_grad_batches, dp_rank, dp_size)
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.accumulate_grad_batches = accumulate_grad_batches
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.shuffle = seed, shuffle
        self.global_batch_size = micro_batch_size * accumulate_grad_batches * dp_size
        if len(dataset) < self.global_batch_size:
            seq_len = dataset.seq_len
            raise ValueError(
                f"the training split has {len(dataset)} blocks of seq_len={seq_len} "
                f"({len(dataset) * seq_len} tokens) but one global batch needs {self.global_batch_size} blocks "
                f"(micro_batch_size={micro_batch_size} x accumulate_grad_batches={accumulate_grad_batches} x "
                f"dp={dp_size}) = {self.global_batch_size * seq_len} tokens. Use more data, or lower "
                "micro_batch_size, accumulate_grad_batches, seq_len or data.val_fraction"
            )
        self._epoch = 0
        self._pos = 0  # global samples of completed global batches in this epoch
        self._micro = 0  # micro-batches of the current step this rank has yielded

    @property
    def steps_per_epoch(self) -> int:
        return len(self.dataset) // self.global_batch_size

    def __len__(self) -> int:
        """Micro-batches per epoch on this rank (a full epoch, from its start)."""
        return self.steps_per_epoch * self.accumulate_grad_batches

    @property
    def epoch(self) -> int:
        return self._epoch

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        order = epoch_order(len(self.dataset), self.seed, self._epoch, self.shuffle)
        mbs, acc = self.micro_batch_size, self.accumulate_grad_batches
        while len(self.dataset) - self._pos >= self.global_batch_size:
            rank_start = self._pos + self.dp_rank * mbs * acc
            j = self._micro
            batch = self.dataset.batch(order[rank_start + j * mbs : rank_start + (j + 1) * mbs])
            # advance the state before yielding: state_dict() right after this batch must count it
            if j + 1 == acc:
                self._pos, self._micro = self._pos + self.global_batch_size, 0
            else:
                self._micro = j + 1
            yield batch
        # Only a pass that runs to its end moves to the next epoch. A loader saved right after the
        # last step of an epoch therefore resumes with an empty pass that closes that epoch, in
        # step with a trainer that counts epochs by passes.
        self._epoch, self._pos, self._micro = self._epoch + 1, 0, 0

    def state_dict(self) -> dict[str, int]:
        """Plain ints (safe for `torch.load(weights_only=True)`): where the next micro-batch comes from."""
        return {
            "epoch": self._epoch,
            "samples_consumed": self._pos,
            "micro_batches_in_step": self._micro,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at the next unseen micro-batch of the run that saved `state`."""
        if int(state["seed"]) != self.seed:
            raise ValueError(
                f"the checkpoint's data order comes from seed={state['seed']} but this loader has "
                f"seed={self.seed}; resume with the same `seed` to continue the same sample order"
            )
        micro = int(state.get("micro_batches_in_step", 0))
        if micro >= self.accumulate_grad_batches:
            raise ValueError(
                f"the checkpoint stopped after micro-batch {micro} of a step but accumulate_grad_batches="
                f"{self.accumulate_grad_batches}; resume mid-step only with the same layout"
            )
        self._epoch, self._pos, self._micro = int(state["epoch"]), int(state["samples_consumed"]), micro


class EvalLoader:
    """Validation micro-batches of this dp rank, in fixed order, restarting at every pass.

    Each pass covers floor(len / (micro_batch_size * dp)) micro-batches per rank, the same count
    on every rank (ranks run the same number of collectives); the few leftover blocks are skipped.
    """

    def __init__(
        self, dataset: PackedDataset, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1
    ) -> None:
        _check_sizes(micro_batch_size, 1, dp_rank, dp_size)
        self.dataset = dataset
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size

    def __len__(self) -> int:
        return len(self.dataset) // (self.micro_batch_size * self.dp_size)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        mbs, g = self.micro_batch_size, self.micro_batch_size * self.dp_size
        for s in range(len(self)):
            start = s * g + self.dp_rank * mbs
            yield self.dataset.batch(np.arange(start, start + mbs))
