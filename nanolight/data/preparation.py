"""Tokenize a corpus once into token shards: scripts/prepare_data.py (`prepare`), and a local
corpus trained on directly, prepared the same way into the data cache (`token_file`).

The source (local files, a hub dataset or `embedded`) is opened as a map-style `datasets`
table and tokenized chunk by chunk: each chunk of rows goes through `datasets.map(num_proc=N)`
(N worker processes, one single-threaded tokenizer each; worker w gets every N-th row, so a run
of long documents cannot leave one worker late) or, with N = 1, through one multi-threaded batch
call in this process. Each chunk is committed (see shards.py), so a killed preparation continues from its last chunk, and one
whose shards were later damaged is repaired from the first damaged shard on.
"""

from __future__ import annotations

import ctypes
import dataclasses
import glob
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from nanolight.checkpoint.atomic import atomic_directory, remove_stale
from nanolight.data.cache import build_once, fingerprint
from nanolight.data.config import EMBEDDED, DataConfig, DataError
from nanolight.data.shards import (
    FORMAT,
    INDEX,
    PROGRESS,
    VERSION,
    PreparedData,
    ShardWriter,
    check_shards,
    is_prepared_dir,
    prepared_leftovers,
    read_index,
    token_dtype,
)
from nanolight.data.sources import (
    check_text_field,
    embedded_corpus,
    local_files,
    local_identity,
    open_hub,
    open_local,
    reading,
)
from nanolight.data.tokenizer import Encoder, resolve_tokenizer, tokenizer_identity, with_eos

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_INPUT_KEYS = ("source", "tokenizer", "text_field", "dtype", "shard_tokens")


@dataclass
class PrepareConfig:
    """A preparation: `data` says what to tokenize and how (the run's own `DataConfig`: `path`,
    `tokenizer`, `text_field`, `num_proc`, `tokenize_batch_size`, ...), the rest where the shards go
    and how they are cut (the prepare_data.py flags that are not data keys)."""

    data: DataConfig
    out: str
    shard_size_mb: float = 256.0
    chunk_docs: int | None = None

    def __post_init__(self) -> None:
        if self.shard_size_mb <= 0:
            raise ValueError(f"--shard-size-mb={self.shard_size_mb} must be > 0 (MB of tokens per shard)")
        if self.chunk_docs is not None and self.chunk_docs < 1:
            raise ValueError("--chunk-docs must be >= 1")
        if not self.out:
            raise ValueError("--out is empty: name the directory to write the shards into")

    @property
    def num_proc(self) -> int:
        """Tokenizing processes (1: this one, the tokenizer multi-threaded)."""
        return self.data.num_proc or 1

    @property
    def docs_per_chunk(self) -> int:
        """Rows committed at a time: a killed run loses at most this much work."""
        return self.chunk_docs or 20_000 * self.num_proc


_FORKING = [0]  # the pid of the process forking now (read by the child: its parent)


def children_die_with_their_parent() -> None:
    """Every process forked from here on (datasets' map workers, its manager process) ends when
    its parent does: a SIGKILLed prepare_data.py runs no cleanup, and they would wait for work
    for ever. Linux's parent-death signal, armed in each child; elsewhere nothing. Idempotent."""
    if _FORKING[0] or not sys.platform.startswith("linux"):
        return
    _FORKING[0] = os.getpid()
    os.register_at_fork(before=lambda: _FORKING.__setitem__(0, os.getpid()), after_in_child=_arm_parent_death)


def _arm_parent_death() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != _FORKING[0]:  # the parent died before the signal was armed
        os._exit(1)


def prepare(
    cfg: PrepareConfig,
    *,
    progress: bool = True,
    after_commit: Callable[[int], None] | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    key: str = "--source",
) -> dict[str, Any]:
    """Tokenize `cfg.data.path` into `cfg.out` (or finish / repair an earlier run there); returns the index.

    `after_commit(next_row)` runs after every committed chunk (tests use it to stop a run midway).
    `tokenizer` is the one `cfg.data.tokenizer` names, when the caller has loaded it already; `key` is
    the option errors name the source by.
    """
    out = os.path.abspath(os.path.expanduser(cfg.out))
    if cfg.num_proc > 1:
        children_die_with_their_parent()
    tok, ds, files = _open_source(cfg, tokenizer, key)
    dtype = token_dtype(len(tok))
    inputs = {
        "source": _source_identity(cfg, files, ds),
        "tokenizer": {
            "name": cfg.data.tokenizer,
            "identity": tokenizer_identity(tok),
            "eos_token_id": tok.eos_token_id,
            "vocab_size": len(tok),
        },
        "text_field": cfg.data.text_field,
        "dtype": dtype.name,
        "shard_tokens": max(1, int(cfg.shard_size_mb * 1e6) // dtype.itemsize),
    }
    os.makedirs(out, exist_ok=True)
    _remove_leftovers(out)
    state = _resume_state(out, inputs)
    if not os.path.isdir(os.path.join(out, "tokenizer")):  # the run loads it from here: no hub access
        with atomic_directory(os.path.join(out, "tokenizer")) as tmp:
            tok.save_pretrained(str(tmp))
    if state == "complete":
        if progress:
            print(f"{out}: already complete (every shard checked against {INDEX})", file=sys.stderr)
        return read_index(out)
    writer = ShardWriter(out, dtype, inputs["shard_tokens"], state)
    if state is None:
        writer.commit(inputs, 0)  # from now on the directory is a preparation a rerun continues
    row = (state or {}).get("next_row", 0)
    _tokenize(cfg, ds, tok, writer, inputs, row, files or [cfg.data.path], progress, after_commit)
    if not writer.shards and (writer.open is None or writer.open["documents"] == 0):
        raise DataError(
            f"{key} {cfg.data.path} holds no text (0 tokens): every `{cfg.data.text_field}` is empty. Check the "
            "files and the text field"
        )
    return writer.finish({"format": FORMAT, "version": VERSION, **inputs}, len(ds))


def _open_source(
    cfg: PrepareConfig, tok: PreTrainedTokenizerBase | None, key: str
) -> tuple[PreTrainedTokenizerBase, Any, list[str] | None]:
    """(tokenizer, map-style dataset, local files or None for a hub dataset) of `cfg`."""
    dcfg = cfg.data
    if cfg.data.path != EMBEDDED and is_prepared_dir(cfg.data.path):
        raise DataError(f"{key} {cfg.data.path} is already a prepared directory; train on it with data.path")
    # the embedded corpus is the source, or what the embedded tokenizer trains on (built once, cached)
    corpus = None
    if cfg.data.path == EMBEDDED or (tok is None and cfg.data.tokenizer == EMBEDDED):
        corpus = embedded_corpus(dcfg.cache_root, dcfg.embedded_max_mb)
    files = [corpus] if cfg.data.path == EMBEDDED and corpus else local_files(cfg.data.path, key=key)
    tok = tok or resolve_tokenizer(dcfg, corpus)
    hf_cache = os.path.join(dcfg.cache_root, "hf-datasets")
    if files:  # downloaded / converted to arrow with the same worker count
        ds = open_local(files, streaming=False, cache_dir=hf_cache, num_proc=cfg.num_proc)
    else:
        ds = open_hub(dcfg, streaming=False, num_proc=cfg.num_proc)
    check_text_field(ds.column_names, cfg.data.text_field)
    return tok, ds, files


def _tokenize(
    cfg: PrepareConfig,
    ds: Any,
    tok: PreTrainedTokenizerBase,
    writer: ShardWriter,
    inputs: dict[str, Any],
    row: int,
    source: list[str],
    progress: bool,
    after_commit: Callable[[int], None] | None,
) -> None:
    """Rows `row`.. of `ds` into `writer`, one committed chunk at a time, behind one progress bar."""
    import datasets
    from tqdm.auto import tqdm

    encoder = Encoder.of(tok, cfg.data.text_field, np.dtype(inputs["dtype"]))
    n_rows, out = len(ds), writer.out
    if progress and row:
        print(f"{out}: resuming at document row {row:,} of {n_rows:,}", file=sys.stderr)
    bar = tqdm(
        total=n_rows,
        initial=row,
        unit="doc",
        unit_scale=True,
        desc="tokenize",
        file=sys.stderr,
        disable=not progress,
    )
    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # one bar: ours (documents and tokens per second)
    start, n_tokens = time.perf_counter(), 0
    try:
        while row < n_rows:
            stop = min(row + cfg.docs_per_chunk, n_rows)
            eos, n, bs = tok.eos_token_id, cfg.num_proc, cfg.data.tokenize_batch_size
            tokens, ends, rows = tokenize_rows(ds, row, stop, encoder, eos, n, bs, out, source)
            writer.add(tokens, ends, rows)
            writer.commit(inputs, stop)
            n_tokens += len(tokens)
            bar.update(stop - row)
            bar.set_postfix_str(f"{n_tokens / (time.perf_counter() - start):,.0f} tok/s")
            row = stop
            if after_commit is not None:
                after_commit(row)
    finally:
        bar.close()
        if was_enabled:
            datasets.enable_progress_bars()
        _remove_leftovers(out)


def _remove_leftovers(out: str) -> None:
    """Temporaries a killed run left: half-written index/progress/tokenizer (atomic.py's names, and
    the `<name>.tmp-*` of earlier versions), map outputs (our names only)."""
    remove_stale(Path(out))
    for name in [f"{n}.tmp-*" for n in (INDEX, PROGRESS, "tokenizer")] + [".chunk-*"]:
        for path in glob.glob(os.path.join(out, name)):
            if os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.remove(path)


def _source_identity(cfg: PrepareConfig, files: list[str] | None, ds: Any) -> dict[str, Any]:
    """What the shards were made from: any change (a file edited, another revision) is a new source."""
    base = {
        "path": cfg.data.path,
        "name": cfg.data.name,
        "split": cfg.data.split,
        "revision": cfg.data.revision,
    }
    if files:
        return {**base, "files": [list(f) for f in local_identity(files)], "num_rows": len(ds)}
    return {**base, "fingerprint": ds._fingerprint, "num_rows": len(ds)}


def _resume_state(out: str, inputs: dict[str, Any]) -> dict[str, Any] | str | None:
    """None (fresh), "complete", or the committed state to continue from."""
    if os.path.exists(os.path.join(out, INDEX)):
        index = read_index(out)
        _check_same_inputs(out, {k: index.get(k) for k in _INPUT_KEYS}, inputs)
        problems = check_shards(out, index)
        if not problems:
            return "complete"
        first_bad = min(i for i, _ in problems)
        print(f"{out}: {problems[0][1]}; re-tokenizing from shard {first_bad} on", file=sys.stderr)
        kept = index["shards"][:first_bad]
        os.remove(os.path.join(out, INDEX))
        return {"shards": kept, "open": None, "next_row": kept[-1]["end_row"] if kept else 0}
    if os.path.exists(os.path.join(out, PROGRESS)):
        with open(os.path.join(out, PROGRESS)) as f:
            state = json.load(f)
        _check_same_inputs(out, state["inputs"], inputs)
        return state
    leftovers = prepared_leftovers(out)  # shards whose index is gone: nothing says they are whole
    if [n for n in os.listdir(out) if n != "tokenizer" and n not in leftovers]:
        raise DataError(f"--out {out} is not empty and holds no preparation: pick a new or empty directory")
    for name in leftovers:
        os.remove(os.path.join(out, name))
    if leftovers:
        print(
            f"{out}: {len(leftovers)} shard files without {INDEX}: preparing again from the start",
            file=sys.stderr,
        )
    return None


def _check_same_inputs(out: str, saved: dict[str, Any], inputs: dict[str, Any]) -> None:
    diff = [k for k in _INPUT_KEYS if saved.get(k) != inputs[k]]
    if diff:
        raise DataError(
            f"--out {out} holds a preparation of other inputs (they differ in: {', '.join(diff)}); "
            "use a new --out directory, or delete this one to start over"
        )


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
    with reading(source):  # e.g. a text that is not a string: name the source, not a worker traceback
        if num_proc <= 1:
            tokens, ends, kept = encoder.documents(ds[start:stop][encoder.text_field], eos)
        else:
            tokens, ends, kept = _map_chunk(ds, start, stop, encoder, eos, num_proc, batch_size, work_dir)
    return tokens, ends, start + np.flatnonzero(kept)


def _map_chunk(
    ds: Any, start: int, stop: int, encoder: Encoder, eos: int, num_proc: int, batch_size: int, work_dir: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`Encoder.documents` of rows [start, stop) through `datasets.map` with `num_proc` workers."""
    import datasets
    import pyarrow as pa
    import pyarrow.compute as pc

    # worker w gets rows start+w, start+w+N, ...: datasets hands each worker a contiguous slice
    order = np.concatenate([np.arange(start + w, stop, num_proc) for w in range(num_proc)])
    features = datasets.Features(
        {"ids": datasets.List(datasets.Value(encoder.dtype.name)), "keep": datasets.Value("bool")}
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
    return (*with_eos(values, lengths[kept], eos), kept)


def token_file(
    cfg: DataConfig,
    tok: PreTrainedTokenizerBase,
    corpus: str | None = None,
) -> PreparedData:
    """The shards of `cfg`'s source under `tok`, prepared (as by scripts/prepare_data.py) into the
    data cache on a miss, so a local corpus is read through the same format and loader.

    Cache key: local files by (path, size, mtime) each, a hub dataset by its `datasets`
    fingerprint (so a hub source is opened through the HF cache even on a cache hit); plus the
    tokenizer's full definition and `text_field`. Shards of one document stream concatenate to
    the same tokens whatever the shard size: the blocks and their order do not depend on it.
    """
    files = [corpus] if cfg.path == EMBEDDED and corpus else local_files(cfg.path)
    if files is not None:
        source: Any = local_identity(files)
    else:
        source = {"hub": cfg.path, "name": cfg.name, "split": cfg.split}
        source["fingerprint"] = open_hub(cfg, streaming=False)._fingerprint
    identity = {"source": source, "tokenizer": tokenizer_identity(tok), "text_field": cfg.text_field}
    path = os.path.join(cfg.cache_root, "shards", fingerprint({**identity, "version": VERSION}))

    def build(tmp: str) -> None:
        data = dataclasses.replace(cfg, path=corpus) if cfg.path == EMBEDDED and corpus else cfg
        prepare(PrepareConfig(data, tmp), progress=False, tokenizer=tok, key="data.path")

    return PreparedData.open(build_once(path, build))
