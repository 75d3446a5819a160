"""One chunk of source rows -> flat token ids with EOS after every document, for the shard writer.

Tokenization calls the Rust tokenizer directly (`encode_batch_fast`: no offsets, no Python
BatchEncoding), since at corpus scale the wrappers cost more than the merges. Rows whose text
is empty or missing are skipped: every kept document is its tokens followed by EOS, exactly as
the flat token file of the same rows (`tokens.encode_texts`).
"""

from __future__ import annotations

import glob
import os
from typing import Any

import numpy as np

from nanolight.data.config import DataError
from nanolight.data.sources import read_error


class Encoder:
    """The `datasets.map` function: a batch of rows -> {"ids": token ids per row, "keep": has text}.

    A class rather than a closure so it pickles into the map workers by value (the tokenizer
    travels as its JSON definition).
    """

    def __init__(self, backend: Any, text_field: str, dtype: np.dtype, worker: bool = False) -> None:
        self.backend, self.text_field, self.dtype = backend, text_field, np.dtype(dtype)
        self.worker = worker  # runs in a map worker process: one thread, one worker per core

    @classmethod
    def of(cls, tokenizer: Any, text_field: str, dtype: np.dtype) -> Encoder:
        """The encoder of a Hugging Face tokenizer; it needs the fast (Rust) backend."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise DataError(
                f"tokenizer {tokenizer.name_or_path!r} has no fast (Rust) backend: load it with "
                "AutoTokenizer (use_fast=True) and save it with save_pretrained, which writes tokenizer.json"
            )
        return cls(backend, text_field, dtype)

    def encode(self, texts: list[str | None]) -> tuple[list[np.ndarray], list[bool]]:
        keep = [bool(t) for t in texts]
        batch = [t for t, k in zip(texts, keep, strict=True) if k]
        fast = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        encoded = iter(fast(batch, add_special_tokens=False))
        empty = np.zeros(0, dtype=self.dtype)
        ids = [np.asarray(next(encoded).ids, dtype=self.dtype) if k else empty for k in keep]
        return ids, keep

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        if self.worker:  # this forked worker's own setting: N workers x N tokenizer threads oversubscribe
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
        ids, keep = self.encode(batch[self.text_field])
        return {"ids": ids, "keep": keep}


def tokenize_rows(
    ds: Any,
    start: int,
    stop: int,
    encoder: Encoder,
    eos: int,
    num_proc: int,
    batch_size: int,
    work_dir: str,
    source: list[str],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, document end offsets, source row per document) of rows [start, stop) of `ds`;
    `source` (the files, or the hub name) is what an error names."""
    try:
        if num_proc <= 1:
            texts = ds[start:stop][encoder.text_field]
            ids, keep = [], []
            for i in range(0, len(texts), batch_size * 64):  # big calls: the tokenizer threads them
                part_ids, part_keep = encoder.encode(texts[i : i + batch_size * 64])
                ids += part_ids
                keep += part_keep
            lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
            values = np.concatenate(ids) if ids else np.zeros(0, dtype=encoder.dtype)
            kept = np.asarray(keep, dtype=bool)
        else:
            lengths, values, kept = _map_chunk(ds, start, stop, encoder, num_proc, batch_size, work_dir)
    except Exception as err:  # e.g. a text that is not a string: name the source, not a worker traceback
        raise read_error(source, err) from err
    rows = start + np.flatnonzero(kept)
    lengths = lengths[kept]
    # each document's tokens, then EOS: insert one EOS after every document's last token
    tokens = np.insert(values, np.cumsum(lengths), np.asarray(eos, dtype=values.dtype))
    return tokens, np.cumsum(lengths + 1), rows


def _map_chunk(
    ds: Any, start: int, stop: int, encoder: Encoder, num_proc: int, batch_size: int, work_dir: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    import datasets
    import pyarrow as pa
    import pyarrow.compute as pc

    list_feature = getattr(datasets, "List", None) or datasets.Sequence  # datasets < 4 calls it Sequence

    # worker w gets rows start+w, start+w+N, ...: datasets hands each worker a contiguous slice
    order = np.concatenate([np.arange(start + w, stop, num_proc) for w in range(num_proc)])
    features = datasets.Features(
        {"ids": list_feature(datasets.Value(encoder.dtype.name)), "keep": datasets.Value("bool")}
    )
    cache = os.path.join(work_dir, f".chunk-{os.getpid()}.arrow")
    workers = min(num_proc, len(order))
    mapped = ds.select(order).map(
        Encoder(encoder.backend, encoder.text_field, encoder.dtype, worker=workers > 1),
        batched=True,
        batch_size=batch_size,
        num_proc=workers,
        remove_columns=ds.column_names,
        features=features,
        cache_file_name=cache,
        load_from_cache_file=False,
    )
    inverse = np.empty(len(order), dtype=np.int64)
    inverse[order - start] = np.arange(len(order))  # back to row order
    table = mapped.data.table.take(pa.array(inverse))
    ids = table.column("ids").combine_chunks()
    lengths = pc.list_value_length(ids).to_numpy(zero_copy_only=False).astype(np.int64)
    values = ids.flatten().to_numpy(zero_copy_only=False).astype(encoder.dtype, copy=False)
    kept = table.column("keep").to_numpy(zero_copy_only=False).astype(bool)
    del mapped, table, ids
    for f in glob.glob(cache.replace(".arrow", "*")):
        os.remove(f)
    return lengths, values, kept
