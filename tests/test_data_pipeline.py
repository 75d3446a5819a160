"""Tokenize + pack + cache on local files, the embedded corpus, streaming, and fix-it errors.

Offline and fast: a tiny byte-level BPE (512 ids) trained in the session fixture stands in for a
real tokenizer; the embedded corpus is capped to a fraction of a MB.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from pathlib import Path

import numpy as np
import pytest
from _data_helpers import DOCS, expected_tokens, write_docs
from omegaconf import OmegaConf
from transformers import AutoTokenizer

import nanolight.data.preparation as preparation_mod
import nanolight.data.tokenizer as tokenizer_mod
from nanolight.data import (
    BatchGeometry,
    DataConfig,
    PreparedData,
    build_datamodule,
    load_tokenizer,
    token_file,
    vocab_size,
)
from nanolight.data.cache import build_once
from nanolight.data.shards import is_prepared_dir


def cfg_for(path: str, cache: str, tok_dir: str, **kw) -> DataConfig:
    return DataConfig(path=path, tokenizer=tok_dir, cache_dir=cache, **kw)


pytest_plugins = ["_data_helpers"]  # the tok / tok_dir fixtures


@pytest.mark.parametrize("ext", [".jsonl", ".json", ".parquet"])
def test_local_formats_tokenize_every_document_followed_by_eos(tmp_path, tok, tok_dir, ext) -> None:
    src = write_docs(str(tmp_path / f"docs{ext}"), DOCS)
    tf = token_file(cfg_for(src, str(tmp_path / "c"), tok_dir), tok)
    assert tf.tokens[:].tolist() == expected_tokens(tok, DOCS)
    assert tf.tokens.dtype == np.uint16 and tf.index["num_tokens"] == len(tf.tokens)
    # one on-disk format: the cache holds what scripts/prepare_data.py writes, opened the same way
    assert is_prepared_dir(tf.path) and PreparedData.open(tf.path).index == tf.index


def test_txt_files_glob_one_document_per_file(tmp_path, tok, tok_dir) -> None:
    for i, d in enumerate(DOCS[:5]):
        (tmp_path / f"{i}.txt").write_text(d + "\nsecond line\n")
    tf = token_file(cfg_for(str(tmp_path / "*.txt"), str(tmp_path / "c"), tok_dir), tok)
    assert tf.tokens[:].tolist() == expected_tokens(tok, [d + "\nsecond line\n" for d in DOCS[:5]])


def test_num_proc_map_path_matches_in_process(tmp_path, tok, tok_dir) -> None:
    src = write_docs(str(tmp_path / "docs.jsonl"), DOCS)
    tf = token_file(cfg_for(src, str(tmp_path / "c"), tok_dir, num_proc=2, tokenize_batch_size=50), tok)
    assert tf.tokens[:].tolist() == expected_tokens(tok, DOCS)


def test_cache_hit_does_not_retokenize_and_change_invalidates(tmp_path, tok, tok_dir, monkeypatch) -> None:
    src = write_docs(str(tmp_path / "docs.jsonl"), DOCS)
    cfg = cfg_for(src, str(tmp_path / "c"), tok_dir)
    first = token_file(cfg, tok)
    mtime = os.stat(os.path.join(first.path, "shard-00000.bin")).st_mtime_ns
    calls = []
    real = preparation_mod.prepare
    monkeypatch.setattr(preparation_mod, "prepare", lambda *a, **k: (calls.append(1), real(*a, **k)))
    again = token_file(cfg, tok)
    assert calls == [] and again.path == first.path
    assert os.stat(os.path.join(first.path, "shard-00000.bin")).st_mtime_ns == mtime
    write_docs(src, DOCS[:100])  # same path, new content: size and mtime change
    changed = token_file(cfg, tok)
    assert calls == [1] and changed.path != first.path
    assert changed.tokens[:].tolist() == expected_tokens(tok, DOCS[:100])


def test_build_datamodule_local_batches_and_val(tmp_path, tok, tok_dir) -> None:
    src = write_docs(str(tmp_path / "docs.jsonl"), DOCS * 5)
    cfg = cfg_for(src, str(tmp_path / "c"), tok_dir, val_fraction=0.1)
    train, val, t = build_datamodule(
        cfg, BatchGeometry(seq_len=16, micro_batch_size=2, accumulate_grad_batches=2, seed=3)
    )
    batch = next(iter(train))
    ids = batch["input_ids"]
    assert ids.shape == (2, 16) and batch["target_ids"].tolist() == [r[1:] + [-100] for r in ids.tolist()]
    n_blocks = len(token_file(cfg, t).tokens) // 16
    assert len(train.source.dataset) + len(val.source.dataset) == n_blocks and len(
        val.source.dataset
    ) == round(0.1 * n_blocks)
    assert set(train.source.dataset.block_ids).isdisjoint(val.source.dataset.block_ids)
    assert vocab_size(t) == 512


def test_embedded_corpus_and_tokenizer_build_once(tmp_path, monkeypatch) -> None:
    cfg = DataConfig(
        cache_dir=str(tmp_path), embedded_max_mb=0.3, tokenizer_train_mb=0.3, embedded_vocab_size=1024
    )
    start = time.perf_counter()
    train, val, tok = build_datamodule(cfg, BatchGeometry(seq_len=64, micro_batch_size=4))
    assert time.perf_counter() - start < 60
    assert len(tok) == 1024 and tok.eos_token == "<|endoftext|>" and tok.eos_token_id == tok.pad_token_id
    tok_dir = next((tmp_path / "tokenizers").glob("embedded-*[!k]"))
    assert len(AutoTokenizer.from_pretrained(str(tok_dir))) == 1024
    corpus = next((tmp_path / "corpus").glob("*[!k]/corpus.jsonl"))
    first_doc = json.loads(corpus.open().readline())
    assert first_doc["path"].endswith(".py") and "test" not in first_doc["path"].split(os.sep)[:-1]
    monkeypatch.setattr(tokenizer_mod, "train_bpe_tokenizer", lambda *a, **k: pytest.fail("retrained"))
    monkeypatch.setattr(preparation_mod, "prepare", lambda *a, **k: pytest.fail("retokenized"))
    train2, _, _ = build_datamodule(cfg, BatchGeometry(seq_len=64, micro_batch_size=4))
    assert next(iter(train2))["input_ids"].tolist() == next(iter(train))["input_ids"].tolist()
    assert val is not None and tok.decode(next(iter(train))["input_ids"][0]).strip()


def test_streaming_datamodule_holds_out_val_blocks(tmp_path, tok, tok_dir) -> None:
    src = write_docs(str(tmp_path / "docs.jsonl"), DOCS * 3)
    cfg = cfg_for(src, str(tmp_path / "c"), tok_dir, streaming=True, val_blocks=4, shuffle_buffer=0)
    train, val, tok = build_datamodule(cfg, BatchGeometry(seq_len=8, micro_batch_size=2))
    assert len(val) == 2
    held = [r for b in val for r in b["input_ids"].tolist()]
    assert np.asarray(held).ravel().tolist() == expected_tokens(tok, DOCS)[:32]  # the stream's first blocks
    assert next(iter(train))["input_ids"].tolist()[0] not in held
    assert not os.path.exists(tmp_path / "c" / "shards")  # streaming writes no token cache


def test_build_once_serializes_concurrent_builders(tmp_path) -> None:
    target = str(tmp_path / "artifact")
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_race, args=(target, str(tmp_path / "log"))) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0] * 4
    assert open(tmp_path / "log").read() == "built\n" and open(os.path.join(target, "out")).read() == "done"


def _race(target: str, log: str) -> None:
    def build(tmp: str) -> None:
        with open(log, "a") as f:
            f.write("built\n")
        time.sleep(0.3)
        with open(os.path.join(tmp, "out"), "w") as f:
            f.write("done")

    build_once(target, build)
    assert open(os.path.join(target, "out")).read() == "done"


# ---- fix-it errors: each names the cause and the fix, within seconds -----------------------------


def test_missing_path(tmp_path, tok_dir) -> None:
    cfg = cfg_for(str(tmp_path / "nope" / "*.jsonl"), str(tmp_path / "c"), tok_dir)
    with pytest.raises(FileNotFoundError, match=r"data.path=.*matches no data file"):
        build_datamodule(cfg, BatchGeometry(seq_len=8, micro_batch_size=1))
    with pytest.raises(FileNotFoundError, match="matches no data file"):
        build_datamodule(
            cfg_for("./missing.jsonl", str(tmp_path / "c"), tok_dir),
            BatchGeometry(seq_len=8, micro_batch_size=1),
        )
    embedded_tok = DataConfig(path="./missing.jsonl", cache_dir=str(tmp_path / "c"))
    with pytest.raises(FileNotFoundError, match="matches no data file"):
        # before training a tokenizer
        build_datamodule(embedded_tok, BatchGeometry(seq_len=8, micro_batch_size=1))
    assert not (tmp_path / "c" / "tokenizers").exists()


def test_empty_dataset(tmp_path, tok_dir) -> None:
    src = write_docs(str(tmp_path / "empty.jsonl"), [""] * 3)
    with pytest.raises(ValueError, match="0 tokens"):
        build_datamodule(
            cfg_for(src, str(tmp_path / "c"), tok_dir), BatchGeometry(seq_len=8, micro_batch_size=1)
        )
    assert not list((tmp_path / "c" / "shards").glob("*[!k]"))  # nothing half-built was published


def test_missing_text_field_lists_columns(tmp_path, tok_dir) -> None:
    src = write_docs(str(tmp_path / "docs.jsonl"), DOCS, field="content")
    with pytest.raises(ValueError, match=r"text_field='text'.*\['content', 'id'\]"):
        build_datamodule(
            cfg_for(src, str(tmp_path / "c"), tok_dir), BatchGeometry(seq_len=8, micro_batch_size=1)
        )


def test_too_few_tokens_for_a_global_batch(tmp_path, tok_dir) -> None:
    src = write_docs(str(tmp_path / "docs.jsonl"), DOCS[:3])
    cfg = cfg_for(src, str(tmp_path / "c"), tok_dir, val_fraction=0.0)
    with pytest.raises(ValueError, match=r"tokens\) but one global batch needs 64 blocks"):
        build_datamodule(
            cfg, BatchGeometry(seq_len=32, micro_batch_size=8, accumulate_grad_batches=4, dp_size=2)
        )


def test_bad_tokenizer_and_config(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="data.tokenizer"):
        load_tokenizer(str(tmp_path / "no-tokenizer"))
    with pytest.raises(ValueError, match="data.val_fraction"):
        DataConfig(val_fraction=1.5)
    with pytest.raises(ValueError, match="data.streaming"):
        DataConfig(streaming=True)


@pytest.mark.parametrize(
    "preset", sorted(p.stem for p in (Path(__file__).parents[1] / "conf" / "data").glob("*.yaml"))
)
def test_conf_data_presets_are_valid_data_configs(preset: str) -> None:
    raw = OmegaConf.to_container(
        OmegaConf.load(Path(__file__).parents[1] / "conf" / "data" / f"{preset}.yaml")
    )
    assert isinstance(DataConfig(**raw), DataConfig)
