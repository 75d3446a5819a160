"""`build_datamodule`: the one call the recipe makes to turn a `DataConfig` into loaders.

One loader, `PackedLoader` (batches, state_dict, the global batch rule of loader.py), over one of
three sources of token rows:
- token shards (shards.py): a directory made by scripts/prepare_data.py (`data.path=<dir>`, nothing
  built at run time), or the embedded corpus, local files or a hub dataset prepared the same way
  once into the data cache (preparation.py `token_file`);
- a mixture of prepared directories (`data.mixture`, mixture.py);
- a stream (`data.streaming=true`): each dp rank reads and tokenizes its share (streaming.py).
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Any, NamedTuple

from nanolight.data.config import EMBEDDED, BatchGeometry, DataConfig, DataError
from nanolight.data.loader import PackedDataset, PackedLoader, eval_loader, split_blocks
from nanolight.data.mixture import ConcatBlocks, MixedRows
from nanolight.data.preparation import token_file
from nanolight.data.shards import INDEX, PreparedData, is_prepared_dir
from nanolight.data.sources import embedded_corpus, local_files, open_hub, open_local
from nanolight.data.streaming import StreamRows, hold_out
from nanolight.data.tokenizer import load_tokenizer, resolve_tokenizer, tokenizer_identity

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class DataModule(NamedTuple):
    """What the recipe gets back; unpacks as `train_loader, val_loader, tokenizer = ...`."""

    train_loader: PackedLoader
    val_loader: PackedLoader | None
    tokenizer: PreTrainedTokenizerBase


def build_datamodule(cfg: DataConfig, geometry: BatchGeometry) -> DataModule:
    """Loaders for this dp rank, the validation loader (None without a val split) and the tokenizer.

    Every rank calls this with the same `cfg` and `geometry` but its own `geometry.dp_rank`;
    cached artifacts are built by one process at a time (cache.py). Train batches are
    {"input_ids", "target_ids"} (micro_batch_size, seq_len) int64, plus "position_ids" and
    "document_ids" with `data.document_mask`; checkpoint `train_loader.state_dict()` after each
    step. The recipe checks `len(tokenizer)` (`nanolight.data.vocab_size`) against the model's.
    """
    if cfg.mixture is not None:
        return _mixture(cfg, geometry)
    if cfg.path != EMBEDDED and is_prepared_dir(cfg.path):
        if cfg.streaming:
            raise DataError(
                f"data.path={cfg.path} is a prepared directory (read by memory map, no tokenizing): "
                "set data.streaming=false"
            )
        data = PreparedData.open(cfg.path)
        return _prepared(cfg, geometry, data, _run_tokenizer([("data.path", data)], cfg.tokenizer))
    if cfg.path != EMBEDDED:
        local_files(cfg.path)  # a missing local path fails now, not after a tokenizer is trained
    corpus = None
    if cfg.path == EMBEDDED or cfg.tokenizer == EMBEDDED:
        corpus = embedded_corpus(cfg.cache_root, cfg.embedded_max_mb)
    tok = resolve_tokenizer(cfg, corpus)
    if cfg.streaming:
        return _streaming(cfg, geometry, tok)
    return _prepared(cfg, geometry, token_file(cfg, tok, corpus), tok)


def _run_tokenizer(sources: list[tuple[str, PreparedData]], tokenizer: str) -> PreTrainedTokenizerBase:
    """The run's tokenizer: `tokenizer` if named (it must be the data's), else the one saved with the data.

    Every source must come from that tokenizer: token ids from another tokenizer mean other text,
    and nothing downstream could tell.
    """
    first = sources[0][1]
    tok = load_tokenizer(first.tokenizer_dir if tokenizer == EMBEDDED else tokenizer)
    identity = tokenizer_identity(tok)
    run_name = (
        tokenizer if tokenizer != EMBEDDED else f"{first.tokenizer['name']!r} from {first.tokenizer_dir}"
    )
    for key, data in sources:
        saved = data.tokenizer
        if saved["identity"] != identity:
            raise DataError(
                f"{key}={data.path}: {os.path.join(data.path, INDEX)} says its tokens come from tokenizer "
                f"{saved['name']!r} (identity {saved['identity']}, {saved['vocab_size']} ids), but this run's "
                f"tokenizer is {run_name} (identity {identity}, {len(tok)} ids). Prepare every source with the "
                "same --tokenizer, and set data.tokenizer to it or leave it at `embedded` (the data's own)"
            )
    return tok


def _blocks(
    data: PreparedData, cfg: DataConfig, seq_len: int, document_eos: int | None
) -> tuple[PackedDataset, PackedDataset]:
    """(train, val) datasets of prepared shards; the held-out blocks are the same at every layout."""
    ids = split_blocks(len(data.tokens) // seq_len, cfg.val_fraction, cfg.val_blocks)
    train, val = (PackedDataset(data.tokens, seq_len, part, document_eos) for part in ids)
    return train, val


def _prepared(
    cfg: DataConfig, geometry: BatchGeometry, data: PreparedData, tok: PreTrainedTokenizerBase
) -> DataModule:
    """Loaders over one set of shards (a prepared directory or the cached preparation)."""
    train, val = _blocks(data, cfg, geometry.seq_len, tok.eos_token_id if cfg.document_mask else None)
    return DataModule(PackedLoader(train, geometry), eval_loader(val, geometry), tok)


def _mixture(cfg: DataConfig, geometry: BatchGeometry) -> DataModule:
    """Loaders over `cfg.mixture` (prepared directories with weights); validation = every source's held-out part."""
    assert cfg.mixture is not None
    keys = [f"data.mixture[{i}].path" for i in range(len(cfg.mixture))]
    opened = [(k, PreparedData.open(m.path, k)) for k, m in zip(keys, cfg.mixture, strict=True)]
    tok = _run_tokenizer(opened, cfg.tokenizer)
    eos = tok.eos_token_id if cfg.document_mask else None
    splits = [_blocks(data, cfg, geometry.seq_len, eos) for _, data in opened]
    names = [f"data.mixture[{i}] ({m.name or m.path})" for i, m in enumerate(cfg.mixture)]
    weights = [m.weight for m in cfg.mixture]
    rows = MixedRows([t for t, _ in splits], weights, names, geometry, cfg.mixture_exhausted)
    val = ConcatBlocks([v for _, v in splits])
    return DataModule(PackedLoader(rows, geometry), eval_loader(val, geometry), tok)


def _streaming(cfg: DataConfig, geometry: BatchGeometry, tok: PreTrainedTokenizerBase) -> DataModule:
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
    seq_len = geometry.seq_len
    held = hold_out(ds, tok, cfg.text_field, seq_len, cfg.val_blocks or 0, cfg.tokenize_batch_size)
    eos = tok.eos_token_id if cfg.document_mask else None
    rows = StreamRows(
        ds,
        tok,
        cfg.text_field,
        geometry,
        shuffle_buffer=cfg.shuffle_buffer,
        skip_documents=held.documents,
        tokenize_batch_size=cfg.tokenize_batch_size,
        document_eos=eos,
        source_files=files or [cfg.path],
    )
    val = eval_loader(PackedDataset(held.tokens, seq_len, None, eos), geometry)
    return DataModule(PackedLoader(rows, geometry), val, tok)
