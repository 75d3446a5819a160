"""`build_datamodule`: the one call the recipe makes to turn a `DataConfig` into loaders.

Four sources, one contract (batches, state_dict, the global batch rule):
- a directory made by scripts/prepare_data.py (`data.path=<dir>`), or several with weights
  (`data.mixture`): memory-mapped shards, nothing built at run time (prepared.py, mixture.py);
- a stream (`data.streaming=true`): each dp rank reads and tokenizes its share (streaming.py);
- otherwise the embedded corpus, local files or a hub dataset, tokenized once into a cached
  token file: embedded corpus (only if asked for) -> tokenizer -> token file -> blocks, each
  step cached and built by one process at a time (see cache.py).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import numpy as np
from transformers import PreTrainedTokenizerBase

from nanolight.data.config import EMBEDDED, DataConfig, DataError
from nanolight.data.corpus import embedded_corpus
from nanolight.data.loader import EvalLoader, PackedLoader
from nanolight.data.mixture import MixtureLoader
from nanolight.data.packed import PackedDataset, split_blocks
from nanolight.data.prepared import build_mixture, build_prepared, eval_loader
from nanolight.data.shards import is_prepared_dir
from nanolight.data.sources import guard_reads, local_files, local_identity, open_hub, open_local
from nanolight.data.stream_loader import StreamingPackedLoader
from nanolight.data.streaming import hold_out
from nanolight.data.tokenizer import resolve_tokenizer, tokenizer_identity
from nanolight.data.tokens import TokenFile, cached_token_file, iter_token_chunks


class DataModule(NamedTuple):
    """What the recipe gets back; unpacks as `train_loader, val_loader, tokenizer = ...`."""

    train_loader: PackedLoader | MixtureLoader | StreamingPackedLoader
    val_loader: EvalLoader | None
    tokenizer: PreTrainedTokenizerBase


def build_datamodule(
    cfg: DataConfig,
    seq_len: int,
    micro_batch_size: int,
    accumulate_grad_batches: int = 1,
    dp_rank: int = 0,
    dp_size: int = 1,
    seed: int = 0,
    barrier: Callable[[], None] | None = None,
    is_builder: bool = True,
) -> DataModule:
    """Loaders for this dp rank, the validation loader (None without a val split) and the tokenizer.

    Every rank calls this with the same `cfg`, sizes and `seed`, and its own `dp_rank`. Cache
    builds are serialized with a file lock; on a filesystem without working file locks, pass a
    `barrier` (e.g. `torch.distributed.barrier`) and `is_builder=(local_rank == 0)`, and every
    rank must then call this (the barrier is entered once per cached artifact on every rank).
    Train batches are {"input_ids", "target_ids"} (micro_batch_size, seq_len) int64 (targets
    already shifted: `docmask.make_batch`), plus "position_ids" and "document_ids" with
    `data.document_mask`; checkpoint
    `train_loader.state_dict()` after each step. The recipe checks `len(tokenizer)`
    (`nanolight.data.vocab_size`) against the model's vocab size.
    """
    sizes = (seq_len, micro_batch_size, accumulate_grad_batches, dp_rank, dp_size, seed)
    if cfg.mixture is not None:
        return DataModule(*build_mixture(cfg, *sizes))
    if cfg.path != EMBEDDED and is_prepared_dir(cfg.path):
        if cfg.streaming:
            raise DataError(
                f"data.path={cfg.path} is a prepared directory (read by memory map, no tokenizing): "
                "set data.streaming=false"
            )
        return DataModule(*build_prepared(cfg, *sizes))
    if cfg.path != EMBEDDED:
        local_files(cfg.path)  # a missing local path fails now, not after a tokenizer is trained
    shared = {"barrier": barrier, "is_builder": is_builder}
    corpus = None
    if cfg.path == EMBEDDED or cfg.tokenizer == EMBEDDED:
        corpus = embedded_corpus(cfg.cache_root, cfg.embedded_max_mb, **shared)
    tok = resolve_tokenizer(cfg, corpus, **shared)
    if cfg.streaming:
        return _streaming(
            cfg, tok, seq_len, micro_batch_size, accumulate_grad_batches, dp_rank, dp_size, seed
        )

    tokens = token_file(cfg, tok, corpus, **shared)
    n_blocks = len(tokens.tokens) // seq_len
    train_ids, val_ids = split_blocks(n_blocks, cfg.val_fraction, cfg.val_blocks)  # the same at every layout
    eos = tok.eos_token_id if cfg.document_mask else None
    train = PackedLoader(
        PackedDataset(tokens.tokens, seq_len, train_ids, eos),
        micro_batch_size, accumulate_grad_batches, dp_rank, dp_size, seed,
    )  # fmt: skip
    val = eval_loader(PackedDataset(tokens.tokens, seq_len, val_ids, eos), micro_batch_size, dp_rank, dp_size)
    return DataModule(train, val, tok)


def token_file(
    cfg: DataConfig,
    tok: PreTrainedTokenizerBase,
    corpus: str | None = None,
    *,
    barrier: Callable[[], None] | None = None,
    is_builder: bool = True,
) -> TokenFile:
    """The cached token file of `cfg`'s source under `tok`, tokenizing only on a cache miss.

    Cache key: local files by (path, size, mtime) each, a hub dataset by its `datasets`
    fingerprint (so a hub source is opened through the HF cache even on a token-cache hit);
    plus the tokenizer's full definition and `text_field`.
    """
    files = [corpus] if cfg.path == EMBEDDED and corpus else local_files(cfg.path)
    base = {"text_field": cfg.text_field, "tokenizer": tokenizer_identity(tok)}
    use_map = bool(cfg.num_proc and cfg.num_proc > 1)
    if files is not None:
        identity = {**base, "source": local_identity(files)}

        def make() -> Iterable[np.ndarray]:
            datasets_cache = os.path.join(cfg.cache_root, "hf-datasets")
            ds = open_local(files, streaming=not use_map, cache_dir=datasets_cache)
            chunks = iter_token_chunks(ds, tok, cfg.text_field, cfg.tokenize_batch_size, cfg.num_proc)
            return guard_reads(chunks, files)

    else:
        hub = open_hub(cfg, streaming=False)
        source = {"hub": cfg.path, "name": cfg.name, "split": cfg.split, "fingerprint": hub._fingerprint}
        identity = {**base, "source": source}

        def make() -> Iterable[np.ndarray]:
            return iter_token_chunks(hub, tok, cfg.text_field, cfg.tokenize_batch_size, cfg.num_proc)

    return cached_token_file(cfg.cache_root, identity, make, len(tok), barrier=barrier, is_builder=is_builder)


def _streaming(
    cfg: DataConfig, tok: PreTrainedTokenizerBase, seq_len: int, micro_batch_size: int,
    accumulate_grad_batches: int, dp_rank: int, dp_size: int, seed: int,
) -> DataModule:  # fmt: skip
    files = local_files(cfg.path)
    ds: Any
    if files is not None:
        ds = open_local(files, streaming=True, cache_dir=os.path.join(cfg.cache_root, "hf-datasets"))
    else:
        ds = open_hub(cfg, streaming=True)
    if cfg.val_blocks is None:
        warnings.warn(
            "data.streaming=true has no validation split unless data.val_blocks is set "
            "(a stream has no length to take data.val_fraction of)",
            stacklevel=3,
        )
    held = hold_out(ds, tok, cfg.text_field, seq_len, cfg.val_blocks or 0, cfg.tokenize_batch_size)
    eos = tok.eos_token_id if cfg.document_mask else None
    train = StreamingPackedLoader(
        ds, tok, cfg.text_field, seq_len, micro_batch_size, accumulate_grad_batches, dp_rank, dp_size, seed,
        shuffle_buffer=cfg.shuffle_buffer, skip_documents=held.documents,
        tokenize_batch_size=cfg.tokenize_batch_size, document_eos=eos, source_files=files or [cfg.path],
    )  # fmt: skip
    val = eval_loader(PackedDataset(held.tokens, seq_len, None, eos), micro_batch_size, dp_rank, dp_size)
    return DataModule(train, val, tok)
