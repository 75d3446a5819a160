"""Shared pieces of the data tests: a tiny offline tokenizer, documents, and file writers."""

from __future__ import annotations

import json
import os

import pytest

from nanolight.data import DataConfig, PrepareConfig, load_tokenizer, prepare
from nanolight.data.tokenizer import train_bpe_tokenizer

DOCS = [f"def f{i}(x):\n    return x * {i}  # doc {i} " + "word " * (i % 7) for i in range(200)]


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("tok") / "bpe")
    train_bpe_tokenizer(iter(DOCS * 3), path, vocab_size=512)
    return path


@pytest.fixture(scope="session")
def tok(tok_dir: str):
    return load_tokenizer(tok_dir)


def write_docs(
    path: str, docs: list[str | None], field: str = "text", row_group_size: int | None = None
) -> str:
    ext = os.path.splitext(path)[1]
    if ext == ".jsonl":
        with open(path, "w") as f:
            f.writelines(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs))
    elif ext == ".json":
        with open(path, "w") as f:
            json.dump([{field: d} for d in docs], f)
    elif ext == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({field: docs}), path, row_group_size=row_group_size)
    return path


def expected_tokens(tok, docs: list[str | None]) -> list[int]:
    """Reference: every non-empty document tokenized alone through the HF API, then EOS."""
    out: list[int] = []
    for d in docs:
        if d:
            out += tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return out


def prepared(source: str, out: str, tok_dir: str, after_commit=None, **kw) -> dict:
    """Prepare `source` into `out` quietly; returns the index."""
    output = {k: kw.pop(k) for k in ("shard_size_mb", "chunk_docs") if k in kw}
    data = {"tokenize_batch_size": 256, **kw}  # prepare_data.py's --batch-size default
    cfg = PrepareConfig(DataConfig(path=source, tokenizer=tok_dir, **data), out, **output)
    return prepare(cfg, progress=False, after_commit=after_commit)


def shard_bytes(out: str) -> dict[str, bytes]:
    """Every file of a prepared directory, by name (tokenizer files included)."""
    files = {}
    for root, _, names in os.walk(out):
        for n in names:
            full = os.path.join(root, n)
            files[os.path.relpath(full, out)] = open(full, "rb").read()
    return files
