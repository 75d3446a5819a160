"""Documents -> one flat token file on disk: every document followed by EOS, built once.

The token file is the whole corpus as a single uint16/uint32 array (`tokens.bin`) plus
`meta.json`. Packing into `seq_len` blocks happens at read time (a reshape of a memory map), so
one token file serves every `seq_len`, and opening it costs nothing however large it is.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from nanolight.data.cache import build_once, fingerprint
from nanolight.data.sources import check_text_field

_FORMAT = 1


def token_dtype(vocab: int) -> np.dtype:
    """Smallest unsigned dtype holding every id: uint16 up to 65536 ids (SmolLM's 49152), else uint32."""
    return np.dtype(np.uint16) if vocab <= 2**16 else np.dtype(np.uint32)


def encode_texts(tok: PreTrainedTokenizerBase, texts: list[str]) -> np.ndarray:
    """Token ids of `texts` concatenated, each document followed by `eos_token_id` (int64)."""
    texts = [t for t in texts if t]
    if not texts:
        return np.zeros(0, dtype=np.int64)
    # one batched call (Rust, multi-threaded); verbose=False: documents longer than the model's
    # context are expected here, packing cuts them, so the tokenizer's length warning is noise
    ids = tok(texts, add_special_tokens=False, verbose=False)["input_ids"]
    return _join_with_eos(ids, tok.eos_token_id)


def _join_with_eos(ids: list[list[int]], eos: int) -> np.ndarray:
    lengths = np.fromiter((len(d) for d in ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=int(lengths.sum()))
    return np.insert(flat, np.cumsum(lengths), eos)  # EOS after every document, the last one too


def iter_token_chunks(
    dataset: Any, tok: PreTrainedTokenizerBase, text_field: str, batch_size: int, num_proc: int | None
) -> Iterator[np.ndarray]:
    """Token chunks of `dataset` in document order.

    With `num_proc` > 1 (a map-style Dataset) tokenization runs in `datasets.map` worker
    processes; otherwise batches are tokenized here, where the fast tokenizer already spreads a
    batch over all cores.
    """
    check_text_field(getattr(dataset, "column_names", None), text_field)
    if num_proc and num_proc > 1 and hasattr(dataset, "__len__"):
        eos = tok.eos_token_id

        def tokenize(batch: dict[str, list]) -> dict[str, list]:
            ids = tok([t for t in batch[text_field] if t], add_special_tokens=False, verbose=False)[
                "input_ids"
            ]
            return {"ids": [d + [eos] for d in ids]}

        mapped = dataset.map(
            tokenize,
            batched=True,
            batch_size=batch_size,
            num_proc=num_proc,
            remove_columns=dataset.column_names,
        )
        for batch in mapped.iter(batch_size=batch_size):
            if batch["ids"]:
                yield np.concatenate([np.asarray(d, dtype=np.int64) for d in batch["ids"]])
        return
    for batch in dataset.iter(batch_size=batch_size):
        check_text_field(list(batch), text_field)  # streams only reveal their columns here
        yield encode_texts(tok, batch[text_field])


@dataclass
class TokenFile:
    """A built token file: `tokens` is a read-only memory map of the whole corpus."""

    path: str
    tokens: np.ndarray
    meta: dict[str, Any]

    @classmethod
    def open(cls, path: str) -> TokenFile:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        tokens = np.memmap(os.path.join(path, "tokens.bin"), dtype=meta["dtype"], mode="r")
        return cls(path, tokens, meta)


def write_token_file(out_dir: str, chunks: Iterable[np.ndarray], vocab: int, info: dict[str, Any]) -> None:
    """Stream `chunks` into `out_dir/tokens.bin` and write `meta.json` (tokens, dtype, seconds)."""
    os.makedirs(out_dir)
    dtype = token_dtype(vocab)
    start, n_tokens = time.perf_counter(), 0
    with open(os.path.join(out_dir, "tokens.bin"), "wb") as f:
        for chunk in chunks:
            if chunk.size and int(chunk.max()) >= 2 ** (8 * dtype.itemsize):
                raise ValueError(f"token id {int(chunk.max())} does not fit {dtype}; tokenizer len={vocab}")
            f.write(chunk.astype(dtype).tobytes())
            n_tokens += chunk.size
    seconds = time.perf_counter() - start
    if n_tokens == 0:
        raise ValueError(
            f"the dataset ({info.get('identity', {}).get('source')}) holds no text: 0 tokens. Check data.path "
            "points at non-empty files and data.text_field at the column with the documents"
        )
    meta = {
        **info,
        "num_tokens": n_tokens,
        "dtype": dtype.name,
        "seconds": round(seconds, 3),
        "format": _FORMAT,
    }
    meta["tokens_per_s"] = round(n_tokens / max(seconds, 1e-9))
    with open(os.path.join(out_dir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)


def cached_token_file(
    cache_root: str,
    identity: dict[str, Any],
    make_chunks: Callable[[], Iterable[np.ndarray]],
    vocab: int,
    *,
    barrier: Callable[[], None] | None = None,
    is_builder: bool = True,
) -> TokenFile:
    """The token file for `identity` (source + tokenizer + text_field), tokenized only on a miss.

    `make_chunks` is called only when the file must be built, so a cache hit never opens the
    source dataset.
    """
    key = fingerprint({**identity, "format": _FORMAT})
    path = os.path.join(cache_root, "tokens", key)
    build_once(
        path,
        lambda tmp: write_token_file(tmp, make_chunks(), vocab, {"identity": identity}),
        barrier=barrier,
        is_builder=is_builder,
    )
    return TokenFile.open(path)
