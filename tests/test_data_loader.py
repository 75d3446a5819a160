"""Packing, dp sharding and resume of the map-style loaders, on synthetic token arrays.

Block b of the synthetic corpus holds tokens b*T .. b*T+T-1, so a batch names its blocks
exactly and any lost or duplicated sample shows up as a count.
"""

from __future__ import annotations

import io
import itertools

import numpy as np
import pytest
import torch

from nanolight.data import BatchGeometry, EvalLoader, PackedDataset, PackedLoader, split_blocks

T = 4
N_BLOCKS = 50
G = 12  # global batch of every layout below
LAYOUTS = [(1, 12, 1), (1, 4, 3), (1, 1, 12), (2, 6, 1), (2, 2, 3), (4, 3, 1), (4, 1, 3)]  # (dp, mbs, acc)


def dataset(n_blocks: int = N_BLOCKS, extra: int = 3) -> PackedDataset:
    return PackedDataset(np.arange(n_blocks * T + extra, dtype=np.uint16), T)


def block_ids(batch: dict[str, torch.Tensor]) -> list[int]:
    return (batch["input_ids"][:, 0] // T).tolist()


def global_batches(dp: int, mbs: int, acc: int, steps: int, seed: int = 7, state=None) -> list[list[int]]:
    """The first `steps` global batches (block ids, rank-major) a layout produces, plus the loaders."""
    loaders = [PackedLoader(dataset(), BatchGeometry(T, mbs, acc, r, dp, seed)) for r in range(dp)]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(state)
    streams = [_forever(loader) for loader in loaders]
    out = []
    for _ in range(steps):
        out.append([b for s in streams for _ in range(acc) for b in block_ids(next(s))])
    return out


def _forever(loader: PackedLoader):
    while True:
        yield from loader


def test_packing_drops_remainder_and_shifts_targets() -> None:
    ds = dataset(extra=T - 1)
    assert len(ds) == N_BLOCKS  # the T-1 trailing tokens do not make a block
    item = ds[3]
    assert item["input_ids"].dtype == torch.int64 and item["input_ids"].shape == (T,)
    assert torch.equal(item["input_ids"], torch.arange(3 * T, 4 * T))
    assert item["target_ids"].tolist() == list(range(3 * T + 1, 4 * T)) + [-100]  # the next token
    batch = ds.batch(np.array([5, 1]))
    assert batch["input_ids"].shape == (2, T) and block_ids(batch) == [5, 1]


def test_global_batch_identical_across_layouts() -> None:
    steps = 3 * (N_BLOCKS // G) + 1  # spans epoch boundaries
    reference = global_batches(*LAYOUTS[0], steps)
    for layout in LAYOUTS[1:]:
        assert global_batches(*layout, steps) == reference, layout


@pytest.mark.parametrize("dp,mbs,acc", [(1, 3, 1), (2, 2, 2), (4, 1, 2), (4, 3, 1)])
def test_no_sample_lost_or_duplicated(dp: int, mbs: int, acc: int) -> None:
    g = dp * mbs * acc
    loaders = [PackedLoader(dataset(), BatchGeometry(T, mbs, acc, r, dp, seed=3)) for r in range(dp)]
    epochs = []
    for _ in range(3):
        seen = [b for loader in loaders for batch in loader for b in block_ids(batch)]
        assert all(len(loader) == (N_BLOCKS // g) * acc for loader in loaders)
        assert (
            len(seen) == len(set(seen)) == (N_BLOCKS // g) * g
        )  # disjoint ranks, only the remainder dropped
        epochs.append(seen)
    assert epochs[0] != epochs[1]  # each epoch is a new permutation
    assert set(itertools.chain(*epochs)) == set(range(N_BLOCKS))  # dropped remainders differ per epoch


def test_shuffle_off_is_sequential_and_seed_changes_order() -> None:
    loader = PackedLoader(dataset(), BatchGeometry(T, 4, 1, 0, 1, seed=0), shuffle=False)
    assert block_ids(next(iter(loader))) == [0, 1, 2, 3]
    assert global_batches(1, 12, 1, 1, seed=1) != global_batches(1, 12, 1, 1, seed=2)


@pytest.mark.parametrize("k", [1, 3, 4, 5, 9])  # 4 steps per epoch: 4 ends an epoch, 5 and 9 cross it
@pytest.mark.parametrize("layout", [(1, 12, 1), (2, 2, 3)])
def test_resume_yields_exactly_the_remaining_batches(k: int, layout: tuple[int, int, int]) -> None:
    dp, mbs, acc = layout
    total = 11
    full = global_batches(dp, mbs, acc, total)
    loaders = [PackedLoader(dataset(), BatchGeometry(T, mbs, acc, r, dp, seed=7)) for r in range(dp)]
    streams = [_forever(loader) for loader in loaders]
    for _ in range(k):
        for s in streams:
            for _ in range(acc):
                next(s)
    buf = io.BytesIO()
    torch.save(loaders[0].state_dict(), buf)  # what the trainer checkpoints after a step
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    assert all(isinstance(v, int) for v in state.values())
    assert global_batches(dp, mbs, acc, total - k, state=state) == full[k:]


def test_resume_at_another_layout_continues_the_same_global_batches() -> None:
    full = global_batches(1, 12, 1, 7)
    loader = PackedLoader(dataset(), BatchGeometry(T, 12, 1, 0, 1, seed=7))
    it = _forever(loader)
    for _ in range(2):
        next(it)
    assert global_batches(4, 1, 3, 5, state=loader.state_dict()) == full[2:]


def test_epoch_loop_protocol_and_mid_step_resume() -> None:
    loader = PackedLoader(dataset(), BatchGeometry(T, 2, 3, 0, 1, seed=1))
    counts = []
    for _ in range(3):
        counts.append(sum(1 for _ in loader))
    assert counts == [len(loader)] * 3 and loader.state_dict()["epoch"] == 3
    a = PackedLoader(dataset(), BatchGeometry(T, 2, 3, 0, 1, seed=1))
    it = iter(a)
    next(it)
    b = PackedLoader(dataset(), BatchGeometry(T, 2, 3, 0, 1, seed=1))
    b.load_state_dict(a.state_dict())  # mid-step (same layout): resumes at micro-batch 1 of the step
    assert block_ids(next(iter(b))) == block_ids(next(it))


def test_saved_at_epoch_end_resumes_with_an_empty_pass_then_next_epoch() -> None:
    """The trainer counts epochs by passes: a loader saved right after an epoch's last step
    (max_steps hit there, generator not exhausted) must close that epoch, not skip into the next."""
    ref = PackedLoader(dataset(), BatchGeometry(T, 12, 1, seed=7))
    epochs = [[block_ids(b) for b in ref] for _ in range(2)]
    a = PackedLoader(dataset(), BatchGeometry(T, 12, 1, seed=7))
    it = iter(a)
    for _ in range(a.steps_per_epoch):
        next(it)
    b = PackedLoader(dataset(), BatchGeometry(T, 12, 1, seed=7))
    b.load_state_dict(a.state_dict())
    assert list(b) == [] and b.epoch == 1
    assert [block_ids(x) for x in b] == epochs[1]


def test_resume_with_other_seed_is_an_error() -> None:
    state = PackedLoader(dataset(), BatchGeometry(T, 4, 1, seed=1)).state_dict()
    with pytest.raises(ValueError, match="seed"):
        PackedLoader(dataset(), BatchGeometry(T, 4, 1, seed=2)).load_state_dict(state)


def test_too_few_blocks_names_tokens_needed() -> None:
    with pytest.raises(ValueError, match=r"50 blocks .* needs 64 blocks") as err:
        PackedLoader(dataset(), BatchGeometry(T, 8, 4, 0, 2))
    assert "256 tokens" in str(err.value) and "micro_batch_size" in str(err.value)


def test_split_blocks_is_deterministic_and_disjoint() -> None:
    train, val = split_blocks(1000, 0.05)
    assert len(val) == 50 and len(train) == 950
    assert set(train).isdisjoint(val) and set(train) | set(val) == set(range(1000))
    assert np.array_equal(val, split_blocks(1000, 0.05)[1])
    assert len(split_blocks(1000, 0.0)[1]) == 0 and len(split_blocks(1000, 0.5, val_blocks=7)[1]) == 7
    assert len(split_blocks(10, 0.001)[1]) == 1  # a positive fraction keeps at least one block
    small, big = split_blocks(1000, 0.001)[1], split_blocks(1000, 0.001, val_blocks=16)[1]
    assert len(big) == 16 and set(small) <= set(big)  # a larger held-out set is a superset, not a reshuffle


def test_eval_loader_shards_and_restarts() -> None:
    ds = dataset()
    loaders = [EvalLoader(ds, BatchGeometry(T, 3, 1, r, 2)) for r in range(2)]
    passes = [[b for batch in loader for b in block_ids(batch)] for loader in loaders]
    assert all(len(loader) == N_BLOCKS // 6 for loader in loaders)
    assert set(passes[0]).isdisjoint(passes[1]) and len(passes[0]) == len(passes[1]) == 24
    assert [b for batch in loaders[0] for b in block_ids(batch)] == passes[0]  # same blocks every pass


def test_batch_geometry_checks_itself() -> None:
    geometry = BatchGeometry(seq_len=T, micro_batch_size=2, accumulate_grad_batches=3, dp_rank=1, dp_size=2)
    assert geometry.global_batch_size == 12 and geometry.rank_offset(2) == 10  # rank 1's third micro-batch
    with pytest.raises(ValueError, match="seq_len must be >= 1"):
        BatchGeometry(seq_len=0, micro_batch_size=1)
    with pytest.raises(ValueError, match="micro_batch_size and accumulate_grad_batches must be >= 1"):
        BatchGeometry(seq_len=T, micro_batch_size=1, accumulate_grad_batches=0)
    with pytest.raises(ValueError, match=r"dp_rank=2 must be in \[0, dp_size=2\)"):
        BatchGeometry(seq_len=T, micro_batch_size=1, dp_rank=2, dp_size=2)
