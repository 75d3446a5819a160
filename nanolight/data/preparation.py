"""Tokenize a corpus once into token shards (scripts/prepare_data.py is the command line).

The source (local files, a hub dataset or `embedded`) is opened as a map-style `datasets`
table and tokenized chunk by chunk: each chunk of rows goes through `datasets.map(num_proc=N)`
(N worker processes, one single-threaded tokenizer each) or, with N = 1, through one
multi-threaded batch call in this process. Each worker gets every N-th row of the chunk rather
than a contiguous slice, so a run of long documents cannot leave one worker late. Each chunk is
committed (see shard_writer.py), so a killed preparation continues from its last chunk, and
one whose shards were later damaged is repaired from the first damaged shard on.
"""

from __future__ import annotations

import ctypes
import glob
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from nanolight.data.cache import write_atomically
from nanolight.data.config import EMBEDDED, DataConfig, DataError
from nanolight.data.corpus import embedded_corpus
from nanolight.data.shard_writer import ShardWriter
from nanolight.data.shards import (
    FORMAT,
    INDEX,
    PROGRESS,
    VERSION,
    check_shards,
    is_prepared_dir,
    prepared_leftovers,
    read_index,
)
from nanolight.data.sources import check_text_field, local_files, local_identity, open_hub, open_local
from nanolight.data.tokenize import Encoder, tokenize_rows
from nanolight.data.tokenizer import resolve_tokenizer, tokenizer_identity
from nanolight.data.tokens import token_dtype

_INPUT_KEYS = ("source", "tokenizer", "text_field", "dtype", "shard_tokens")


@dataclass
class PrepareConfig:
    """What to tokenize, with which tokenizer, into which directory (the prepare_data.py flags)."""

    source: str
    tokenizer: str
    out: str
    name: str | None = None
    split: str = "train"
    revision: str | None = None
    text_field: str = "text"
    num_proc: int = 1
    shard_size_mb: float = 256.0
    chunk_docs: int | None = None
    batch_size: int = 256
    cache_dir: str = "~/.cache/nanolight"

    def __post_init__(self) -> None:
        if self.num_proc < 1:
            raise ValueError(f"--num-proc={self.num_proc} must be >= 1 (1 = one multi-threaded process)")
        if self.shard_size_mb <= 0:
            raise ValueError(f"--shard-size-mb={self.shard_size_mb} must be > 0 (MB of tokens per shard)")
        if self.chunk_docs is not None and self.chunk_docs < 1 or self.batch_size < 1:
            raise ValueError("--chunk-docs and --batch-size must be >= 1")
        if not self.out:
            raise ValueError("--out is empty: name the directory to write the shards into")

    @property
    def docs_per_chunk(self) -> int:
        """Rows committed at a time: a killed run loses at most this much work."""
        return self.chunk_docs or 20_000 * self.num_proc

    def data_config(self) -> DataConfig:
        return DataConfig(
            path=self.source, name=self.name, split=self.split, revision=self.revision,
            text_field=self.text_field, tokenizer=self.tokenizer, cache_dir=self.cache_dir,
        )  # fmt: skip


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
    cfg: PrepareConfig, *, progress: bool = True, after_commit: Callable[[int], None] | None = None
) -> dict[str, Any]:
    """Tokenize `cfg.source` into `cfg.out` (or finish / repair an earlier run there); returns the index.

    `after_commit(next_row)` runs after every committed chunk (tests use it to stop a run midway).
    """
    out = os.path.abspath(os.path.expanduser(cfg.out))
    if cfg.num_proc > 1:
        children_die_with_their_parent()
    tok, ds, files = _open_source(cfg)
    dtype = token_dtype(len(tok))
    inputs = {
        "source": _source_identity(cfg, files, ds),
        "tokenizer": {
            "name": cfg.tokenizer,
            "identity": tokenizer_identity(tok),
            "eos_token_id": tok.eos_token_id,
            "vocab_size": len(tok),
        },
        "text_field": cfg.text_field,
        "dtype": dtype.name,
        "shard_tokens": max(1, int(cfg.shard_size_mb * 1e6) // dtype.itemsize),
    }
    os.makedirs(out, exist_ok=True)
    _remove_leftovers(out)
    state = _resume_state(out, inputs)
    if not os.path.isdir(os.path.join(out, "tokenizer")):  # the run loads it from here: no hub access
        write_atomically(os.path.join(out, "tokenizer"), tok.save_pretrained)
    if state == "complete":
        if progress:
            print(f"{out}: already complete (every shard checked against {INDEX})", file=sys.stderr)
        return read_index(out)
    writer = ShardWriter(out, dtype, inputs["shard_tokens"], state)
    if state is None:
        writer.commit(inputs, 0)  # from now on the directory is a preparation a rerun continues
    _tokenize(
        cfg,
        ds,
        tok,
        writer,
        inputs,
        (state or {}).get("next_row", 0),
        files or [cfg.source],
        progress,
        after_commit,
    )
    if not writer.shards and (writer.open is None or writer.open["documents"] == 0):
        raise DataError(
            f"--source {cfg.source} holds no text: every `{cfg.text_field}` is empty. Check the files and "
            "--text-field"
        )
    return writer.finish({"format": FORMAT, "version": VERSION, **inputs}, len(ds))


def _open_source(cfg: PrepareConfig) -> tuple[PreTrainedTokenizerBase, Any, list[str] | None]:
    """(tokenizer, map-style dataset, local files or None for a hub dataset) of `cfg`."""
    dcfg = cfg.data_config()
    if cfg.source != EMBEDDED and is_prepared_dir(cfg.source):
        raise DataError(f"--source {cfg.source} is already a prepared directory; train on it with data.path")
    # the embedded corpus is the source, or what the embedded tokenizer trains on (built once, cached)
    corpus = None
    if EMBEDDED in (cfg.source, cfg.tokenizer):
        corpus = embedded_corpus(dcfg.cache_root, dcfg.embedded_max_mb)
    files = [corpus] if cfg.source == EMBEDDED and corpus else local_files(cfg.source, key="--source")
    tok = resolve_tokenizer(dcfg, corpus)
    hf_cache = os.path.join(dcfg.cache_root, "hf-datasets")
    if files:  # downloaded / converted to arrow with the same worker count
        ds = open_local(files, streaming=False, cache_dir=hf_cache, num_proc=cfg.num_proc)
    else:
        ds = open_hub(dcfg, streaming=False, num_proc=cfg.num_proc)
    check_text_field(ds.column_names, cfg.text_field)
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

    encoder = Encoder.of(tok, cfg.text_field, np.dtype(inputs["dtype"]))
    n_rows, out = len(ds), writer.out
    bar = _progress_bar(progress, n_rows, row, out)
    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # one bar: ours (documents and tokens per second)
    start, n_tokens = time.perf_counter(), 0
    try:
        while row < n_rows:
            stop = min(row + cfg.docs_per_chunk, n_rows)
            eos, n, bs = tok.eos_token_id, cfg.num_proc, cfg.batch_size
            tokens, ends, rows = tokenize_rows(ds, row, stop, encoder, eos, n, bs, out, source)
            writer.add(tokens, ends, rows)
            writer.commit(inputs, stop)
            n_tokens += len(tokens)
            if bar is not None:
                bar.update(stop - row)
                bar.set_postfix_str(f"{n_tokens / (time.perf_counter() - start):,.0f} tok/s")
            row = stop
            if after_commit is not None:
                after_commit(row)
    finally:
        if bar is not None:
            bar.close()
        if was_enabled:
            datasets.enable_progress_bars()
        _remove_leftovers(out)


def _remove_leftovers(out: str) -> None:
    """Temporaries a killed run left: half-written index/progress/tokenizer, map outputs (our names only)."""
    names = [f"{n}.tmp-*" for n in (INDEX, PROGRESS, "tokenizer")] + [".chunk-*"]
    for path in [p for n in names for p in glob.glob(os.path.join(out, n))]:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.remove(path)


def _source_identity(cfg: PrepareConfig, files: list[str] | None, ds: Any) -> dict[str, Any]:
    """What the shards were made from: any change (a file edited, another revision) is a new source."""
    base = {"path": cfg.source, "name": cfg.name, "split": cfg.split, "revision": cfg.revision}
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


def _progress_bar(enabled: bool, total: int, done: int, out: str) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    if done:
        print(f"{out}: resuming at document row {done:,} of {total:,}", file=sys.stderr)
    return tqdm(total=total, initial=done, unit="doc", unit_scale=True, desc="tokenize", file=sys.stderr)
