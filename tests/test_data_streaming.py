"""Streaming through local files read with `streaming=True` (the hub path without a network): each dp
rank reads about 1/dp of the bytes, resume restores the stream's own state (equal to an
uninterrupted stream, re-reading at most a window), the same documents at every layout with the
same dp, another dp refused, validation documents never trained on."""

from __future__ import annotations

import io

import datasets
import numpy as np
import pytest
import torch
from _data_helpers import DOCS, write_docs

from nanolight.data import BatchGeometry, DataConfig, PackedLoader, StreamingPackedLoader, build_datamodule
from nanolight.data.streaming import digest

T = 16
pytestmark = pytest.mark.filterwarnings("ignore:dp rank .* read its whole share")

pytest_plugins = ["_data_helpers"]  # the tok / tok_dir fixtures


def rchar() -> int:
    """Bytes this process has read through read()/pread() so far (page-cache hits included)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


@pytest.fixture
def jsonl_stream(tmp_path):
    docs = [f"{d} {i}" * 3 for i, d in enumerate(DOCS)]  # 200 distinct documents over 4 files
    files = [write_docs(str(tmp_path / f"part{k}.jsonl"), docs[k * 50 : (k + 1) * 50]) for k in range(4)]
    return datasets.load_dataset("json", data_files=files, split="train", streaming=True), docs


def loaders(ds, tok, dp: int, mbs: int = 1, acc: int = 1, window: int = 8, **kw) -> list[PackedLoader]:
    return [
        StreamingPackedLoader(
            ds, tok, "text", BatchGeometry(T, mbs, acc, r, dp, seed=5), shuffle_buffer=window, **kw
        )
        for r in range(dp)
    ]


class _SecondPass(Exception):
    pass


def first_pass(loader: PackedLoader) -> tuple[int, list[list[int]]]:
    """(bytes read, rows served) over exactly one reading of the loader's share of the stream."""
    make, opened = loader.source.stream.make_stream, []

    def counted():
        opened.append(1)
        if len(opened) > 1:
            raise _SecondPass  # stop before the next pass reads anything
        return make()

    loader.source.stream.make_stream = counted
    start, rows = rchar(), []
    try:
        for batch in loader:
            rows += batch["input_ids"].tolist()
    except _SecondPass:
        return rchar() - start, rows
    raise AssertionError("unreachable: the loader never ends")


def global_steps(ls: list[PackedLoader], acc: int, n: int) -> list[list[list[int]]]:
    its = [iter(loader) for loader in ls]
    return [
        [row for it in its for _ in range(acc) for row in next(it)["input_ids"].tolist()] for _ in range(n)
    ]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_each_rank_reads_about_one_over_dp_of_the_bytes(tmp_path, tok, jsonl_stream, fmt) -> None:
    ds, docs = jsonl_stream
    if fmt == "parquet":  # one file of 4 row groups of ~1 MB: the stream is resharded per row group
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = str(tmp_path / "all.parquet")
        big = [d * 20 for d in docs] * 4  # rows of ~1.2 KB; pyarrow adds a 64 KB footer read per shard
        pq.write_table(pa.table({"text": big}), path, row_group_size=200, compression="none")
        ds = datasets.load_dataset("parquet", data_files=[path], split="train", streaming=True)
    whole, rows1 = first_pass(loaders(ds, tok, 1)[0])
    for dp in (2, 4) if fmt == "jsonl" else (2,):
        reads = [first_pass(loader) for loader in loaders(ds, tok, dp)]
        per_rank = [b for b, _ in reads]
        assert all(abs(b - whole / dp) < 0.15 * whole / dp for b in per_rank), (dp, per_rank, whole)
        assert abs(sum(per_rank) - whole) < 0.1 * whole
        served = sum(len(r) for _, r in reads)
        assert abs(served - len(rows1)) <= dp  # the ranks share the blocks out (each drops < 1 block)


def test_ranks_read_disjoint_documents_that_cover_the_stream(tok, jsonl_stream) -> None:
    ds, docs = jsonl_stream
    per_rank = []
    for loader in loaders(ds, tok, 2, window=1):
        texts = [t for _, _, batch, _ in loader.source.stream.batches(None) for t in batch]
        per_rank.append(texts)
        served = np.concatenate(
            [b["input_ids"].numpy().ravel() for _, b in zip(range(10), loader, strict=False)]
        )
        encoded = np.concatenate(
            [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
        )
        assert served.tolist() == encoded[: len(served)].tolist()  # window=1: stream order, every token
    assert set(per_rank[0]).isdisjoint(per_rank[1]) and sorted(per_rank[0] + per_rank[1]) == sorted(docs)


def _count_reads(loader: PackedLoader, counts: list[int]) -> None:
    real = loader.source.stream.batches

    def counted(state):
        for item in real(state):
            counts.append(len(item[2]))  # documents in this read batch
            yield item

    loader.source.stream.batches = counted


@pytest.mark.parametrize("stop", [1, 5, 8, -1])  # mid-window, at a window edge, past a rank's pass end
def test_resume_equals_the_uninterrupted_stream_and_rereads_at_most_a_window(tok, jsonl_stream, stop) -> None:
    ds, _ = jsonl_stream
    dp, mbs, acc, window, batch = 2, 2, 2, 8, 4
    kw = {"window": window, "tokenize_batch_size": batch}
    if stop == -1:  # the step after rank 0 starts its second pass over its share
        probe = loaders(ds, tok, dp, mbs, acc, **kw)[0]
        it, stop = iter(probe), 0
        while probe.state_dict()["pass"] == 0:
            stop += 1
            for _ in range(acc):
                next(it)
        stop += 1
    n = stop + 12
    ref = global_steps(loaders(ds, tok, dp, mbs, acc, **kw), acc, n)
    first = loaders(ds, tok, dp, mbs, acc, **kw)
    read_before = []
    _count_reads(first[0], read_before)
    head = global_steps(first, acc, stop)
    states = []
    for loader in first:
        buf = io.BytesIO()
        torch.save(loader.state_dict(), buf)
        buf.seek(0)
        states.append(torch.load(buf, weights_only=True))  # what a checkpoint hands back
    resumed = loaders(ds, tok, dp, mbs, acc, **kw)
    for loader, state in zip(resumed, states, strict=True):
        loader.load_state_dict(state)
    read_after = []
    _count_reads(resumed[0], read_after)
    next(iter(resumed[0]))
    # to serve its first block a resumed rank re-reads one window (8 blocks of 16 tokens; documents
    # hold >= 10 tokens) and one read batch, not the stream up to the checkpoint
    assert sum(read_after) <= window * T // 10 + 2 * batch
    if states[0]["pass"] == 1:
        assert stop > 8 and sum(read_before) > 3 * sum(read_after)
    assert stop < 9 or states[0]["pass"] == 1
    resumed = loaders(ds, tok, dp, mbs, acc, **kw)
    for loader, state in zip(resumed, states, strict=True):
        loader.load_state_dict(state)
    assert head + global_steps(resumed, acc, n - stop) == ref


def test_same_documents_at_every_layout_with_the_same_dp(tok, jsonl_stream) -> None:
    ds, _ = jsonl_stream
    ref = global_steps(loaders(ds, tok, 2, 4, 1), 1, 12)
    assert global_steps(loaders(ds, tok, 2, 1, 4), 4, 12) == ref
    assert global_steps(loaders(ds, tok, 2, 2, 2), 2, 12) == ref


def test_resume_at_another_dp_or_rank_is_refused(tok, jsonl_stream) -> None:
    ds, _ = jsonl_stream
    two = loaders(ds, tok, 2, 2)
    next(iter(two[1]))
    with pytest.raises(ValueError, match=r"saved at dp=2 and is resumed at dp=4.*prepared data"):
        loaders(ds, tok, 4, 1)[0].load_state_dict(two[0].state_dict())
    with pytest.raises(ValueError, match="dp rank 0 was handed the stream position of dp rank 1"):
        loaders(ds, tok, 2, 2)[0].load_state_dict(two[1].state_dict())
    with pytest.raises(ValueError, match="non-streaming loader"):
        two[0].load_state_dict({"epoch": 0, "samples_consumed": 0, "seed": 5})


def test_validation_documents_are_the_streams_first_and_never_trained_on(tmp_path, tok_dir) -> None:
    docs = [f"{d} {i}" * 3 for i, d in enumerate(DOCS)]
    for k in range(4):
        write_docs(str(tmp_path / f"part{k}.jsonl"), docs[k * 50 : (k + 1) * 50])
    cfg = DataConfig(path=str(tmp_path / "*.jsonl"), tokenizer=tok_dir, streaming=True, val_blocks=6)
    for dp in (1, 2):
        dms = [build_datamodule(cfg, BatchGeometry(T, 2, 1, r, dp, seed=1)) for r in range(dp)]
        tok = dms[0].tokenizer
        val = [row for b in dms[0].val_loader for row in b["input_ids"].tolist()]
        ids = np.concatenate(
            [tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for d in docs[:20]]
        )
        assert len(val) == 6 // (2 * dp) * 2 and val[0] == ids[:T].tolist()  # the stream's first blocks
        held = dms[0].train_loader.source.stream.skip
        assert digest(docs[0]) in held and len(held) < 70
        for dm in dms:
            texts = [t for _, _, batch, _ in dm.train_loader.source.stream.batches(None) for t in batch]
            assert texts and not {digest(t) for t in texts} & held
