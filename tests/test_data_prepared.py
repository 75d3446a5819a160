"""Training from prepared shards: the same batches as the cache's own preparation at every layout, per-rank
reads of about 1/dp of the bytes, resume at another dp, and fix-it errors before training."""

from __future__ import annotations

import numpy as np
import pytest
from _data_helpers import DOCS, prepared, write_docs

from nanolight.data import BatchGeometry, DataConfig, DataError, build_datamodule
from nanolight.data.sources import embedded_corpus
from nanolight.data.tokenizer import embedded_tokenizer_dir, tokenizer_identity
from nanolight.models.llama_config import LlamaConfig
from nanolight.pretrain.config import ConfigError, PretrainConfig, TrainConfig
from nanolight.pretrain.run import build_data

T, STEPS = 32, 6

pytest_plugins = ["_data_helpers"]  # the tok / tok_dir fixtures


def steps(
    cfg: DataConfig, dp: int, mbs: int, acc: int, n: int, seed: int = 3, state=None
) -> list[list[list[int]]]:
    """The first `n` global batches (rows, rank-major) of a layout, from fresh loaders."""
    loaders = [build_datamodule(cfg, BatchGeometry(T, mbs, acc, r, dp, seed)).train_loader for r in range(dp)]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
    its = [iter(loader) for loader in loaders]
    return [
        [row for it in its for _ in range(acc) for row in next(it)["input_ids"].tolist()] for _ in range(n)
    ]


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> tuple[DataConfig, DataConfig]:
    """(data.path=embedded, data.path=<the same corpus and tokenizer, prepared>)."""
    cache = str(tmp_path_factory.mktemp("cache"))
    flat = DataConfig(cache_dir=cache, embedded_max_mb=0.4, tokenizer_train_mb=0.3, embedded_vocab_size=1024)
    corpus = embedded_corpus(flat.cache_root, flat.embedded_max_mb)
    tok_path = embedded_tokenizer_dir(flat, corpus)
    out = str(tmp_path_factory.mktemp("prep") / "stdlib")
    prepared(corpus, out, tok_path, shard_size_mb=0.05, num_proc=2, cache_dir=cache)
    return flat, DataConfig(path=out, cache_dir=cache, val_fraction=flat.val_fraction)


def test_prepared_embedded_corpus_gives_the_token_files_batches_at_every_layout(embedded) -> None:
    flat, prep = embedded
    ref = steps(flat, 1, 4, 1, STEPS)
    assert steps(prep, 1, 4, 1, STEPS) == ref
    assert steps(prep, 2, 1, 2, STEPS) == ref and steps(prep, 4, 1, 1, STEPS) == ref
    a, b = build_datamodule(flat, BatchGeometry(T, 2)), build_datamodule(prep, BatchGeometry(T, 2))
    assert tokenizer_identity(a.tokenizer) == tokenizer_identity(b.tokenizer)  # the data's own tokenizer
    assert [x["input_ids"].tolist() for x in a.val_loader] == [x["input_ids"].tolist() for x in b.val_loader]


def test_resume_at_another_dp_continues_the_same_global_batches(embedded) -> None:
    _, prep = embedded
    ref = steps(prep, 1, 4, 1, STEPS)
    first = build_datamodule(prep, BatchGeometry(T, 4, 1, 0, 1, 3)).train_loader
    it = iter(first)
    for _ in range(2):
        next(it)
    assert steps(prep, 2, 2, 1, STEPS - 2, state=first.state_dict()) == ref[2:]


def test_each_dp_rank_reads_only_its_own_samples_bytes(embedded) -> None:
    _, prep = embedded
    dp, mbs, n = 4, 2, 10
    loaders = [build_datamodule(prep, BatchGeometry(T, mbs, 1, r, dp, 3)).train_loader for r in range(dp)]
    for loader in loaders:
        it = iter(loader)
        for _ in range(n):
            next(it)
    per_rank = [loader.source.dataset.tokens.bytes_read for loader in loaders]
    total_needed = dp * mbs * n * T * 2  # the samples of n global batches, uint16
    assert sum(per_rank) == total_needed
    assert per_rank == [total_needed // dp] * dp  # exactly its own samples: 1/dp each


def test_an_index_from_another_tokenizer_is_refused(tmp_path, tok_dir, embedded) -> None:
    flat, _ = embedded
    src = write_docs(str(tmp_path / "docs.jsonl"), DOCS * 3)
    out = str(tmp_path / "out")
    prepared(src, out, tok_dir)
    other = embedded_tokenizer_dir(flat, embedded_corpus(flat.cache_root, flat.embedded_max_mb))
    with pytest.raises(
        DataError, match=r"out/index.json says its tokens come from tokenizer .*bpe.*identity"
    ):
        build_datamodule(DataConfig(path=out, tokenizer=other), BatchGeometry(T, 2))
    assert (
        build_datamodule(DataConfig(path=out, tokenizer=tok_dir), BatchGeometry(T, 2)).tokenizer is not None
    )  # the same one


def test_tokenizer_larger_than_the_model_vocab_is_refused_before_training(embedded) -> None:
    _, prep = embedded
    small = LlamaConfig.preset("smollm-tiny", vocab_size=512)
    config = PretrainConfig(model=small, data=prep, trainer=TrainConfig(micro_batch_size=2, seq_len=T))
    with pytest.raises(ConfigError, match=r"has 1024 tokens but the model's vocab_size is 512"):
        build_data(config)


def test_prepared_dir_errors(tmp_path, tok_dir) -> None:
    src = write_docs(str(tmp_path / "docs.jsonl"), DOCS)
    out = str(tmp_path / "out")
    prepared(src, out, tok_dir)
    with pytest.raises(DataError, match="data.streaming=false"):
        build_datamodule(DataConfig(path=out, streaming=True), BatchGeometry(T, 2))
    with pytest.raises(ValueError, match=r"one global batch needs \d+ blocks"):
        build_datamodule(DataConfig(path=out, val_fraction=0), BatchGeometry(T, 64, dp_size=8))
    rows = np.fromfile(f"{out}/shard-00000.bin", dtype=np.uint16)
    assert len(rows) > 0
