"""`data.document_mask=true`: `position_ids` restart at each document and `document_ids` separate the
documents of a packed row, on every data path; nothing crosses a row. (The model side -- a
block-diagonal attention mask built from them -- is tested with the model.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _data_helpers import DOCS, prepared, write_docs

from nanolight.data import BatchGeometry, DataConfig, build_datamodule, document_fields

T = 24

pytest_plugins = ["_data_helpers"]  # the tok / tok_dir fixtures


def reference(row: list[int], eos: int) -> tuple[list[int], list[int]]:
    """Per token: position within its document and the document's number in the row (EOS ends one)."""
    pos, doc, p, d = [], [], 0, 0
    for t in row:
        pos.append(p)
        doc.append(d)
        p += 1
        if t == eos:
            p, d = 0, d + 1
    return pos, doc


def test_fields_match_a_token_by_token_reference() -> None:
    eos = 0
    fixed = torch.tensor([[5, 6, eos, 7, eos, eos, 8, 9], [eos, 1, 2, 3, 4, 5, 6, eos]])
    out = document_fields(fixed, eos)
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], [0, 0, 1, 2, 3, 4, 5, 6]]
    assert out["document_ids"].tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0, 1, 1, 1, 1, 1, 1, 1]]
    rows = torch.from_numpy(np.random.default_rng(0).integers(0, 4, size=(64, 33)))  # many EOS patterns
    out = document_fields(rows, eos)
    assert out["position_ids"].dtype == out["document_ids"].dtype == torch.int64
    for r in range(len(rows)):
        pos, doc = reference(rows[r].tolist(), eos)
        assert out["position_ids"][r].tolist() == pos and out["document_ids"][r].tolist() == doc


def _check_batch(batch: dict[str, torch.Tensor], eos: int, mbs: int) -> None:
    ids = batch["input_ids"]
    assert set(batch) == {
        "input_ids",
        "target_ids",
        "position_ids",
        "document_ids",
        "cu_seqlens",
        "max_seqlen",
    }
    # targets: the next token of the same document; -100 after a document's end and at the row's end
    want = torch.cat([ids[:, 1:], torch.full((mbs, 1), -100)], dim=1)
    want[:, :-1][ids[:, :-1] == eos] = -100
    assert torch.equal(batch["target_ids"], want)
    assert batch["position_ids"].shape == batch["document_ids"].shape == ids.shape == (mbs, T)
    for r in range(mbs):  # each row on its own: starts at 0 / document 0, restarts after every EOS
        pos, doc = reference(ids[r].tolist(), eos)
        assert batch["position_ids"][r].tolist() == pos and batch["document_ids"][r].tolist() == doc
    after_eos = torch.zeros_like(ids, dtype=torch.bool)
    after_eos[:, 1:] = ids[:, :-1] == eos
    assert (batch["position_ids"][after_eos] == 0).all() and after_eos.any()
    # flash-attn's offsets over the flattened rows: a sequence starts where a position is 0
    starts = (batch["position_ids"].reshape(-1) == 0).nonzero().squeeze(-1).tolist()
    assert batch["cu_seqlens"].dtype == torch.int32 and batch["cu_seqlens"].tolist() == [*starts, ids.numel()]
    assert batch["max_seqlen"] == int(batch["position_ids"].max()) + 1


@pytest.mark.parametrize("path", ["flat", "prepared", "mixture", "streaming"])
def test_every_data_path_yields_document_fields_when_asked(tmp_path, tok, tok_dir, path) -> None:
    src = write_docs(str(tmp_path / "docs.jsonl"), DOCS * 2)
    cache = str(tmp_path / "c")
    if path in ("prepared", "mixture"):
        prepared(src, str(tmp_path / "p"), tok_dir)
    kw = {
        "flat": {"path": src, "tokenizer": tok_dir},
        "prepared": {"path": str(tmp_path / "p")},
        "mixture": {"mixture": [{"path": str(tmp_path / "p"), "weight": 1}]},
        "streaming": {"path": src, "tokenizer": tok_dir, "streaming": True, "val_blocks": 4},
    }[path]
    on = build_datamodule(DataConfig(cache_dir=cache, document_mask=True, **kw), BatchGeometry(T, 2, seed=1))
    off = build_datamodule(DataConfig(cache_dir=cache, **kw), BatchGeometry(T, 2, seed=1))
    it_on, it_off = iter(on.train_loader), iter(off.train_loader)
    for _ in range(5):
        a, b = next(it_on), next(it_off)
        _check_batch(a, tok.eos_token_id, 2)
        assert set(b) == {"input_ids", "target_ids"} and torch.equal(a["input_ids"], b["input_ids"])
    _check_batch(next(iter(on.val_loader)), tok.eos_token_id, 2)
