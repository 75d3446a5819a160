"""The prepared-data format: token shards plus `index.json`, and its memory-mapped reader.

A directory made by scripts/prepare_data.py holds

    index.json          what is in it: dtype, tokenizer identity and EOS id, source fingerprint,
                        and per shard its file names, token and document counts and source rows
    shard-00000.bin     token ids (uint16, or uint32 for vocabularies above 65536), every
                        document followed by EOS, documents never split across shards
    tokenizer/          the tokenizer, saved with save_pretrained, so a run needs no hub access

Together the shards are one token stream, packed into `seq_len` samples at read time, so one
preparation serves every `seq_len`. It is the one on-disk token format: a local corpus trained
on directly is prepared into it in the data cache. Opening checks every file's size against the
index (a missing or truncated shard is an error naming it) and maps nothing: a shard is
memory-mapped the first time one of this rank's samples touches it.

Document boundaries are the EOS tokens themselves (what the loaders' document fields read), so
nothing else is stored per document; preparations before that also wrote ``shard-NNNNN.doc`` end
offsets, which nothing reads (they are left alone, and cleaned up with their shard).

The writer appends documents to the open shard's file and closes the shard at the first
document end at or past `shard_tokens`, so shard boundaries depend on the token stream alone
(not on chunking, worker count or where a run was killed) and the same inputs give the same
bytes. After each chunk, `commit` flushes and fsyncs the file and then atomically rewrites
prepare.json with the committed sizes and the next source row. Restarting truncates the open
shard back to those sizes, drops any shard begun after them, and goes on from that row.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from nanolight.checkpoint.atomic import atomic_write_text
from nanolight.data.config import DataError

INDEX = "index.json"
PROGRESS = "prepare.json"  # present while a preparation is unfinished
FORMAT = "nanolight-tokens"
VERSION = 1


def token_dtype(vocab: int) -> np.dtype:
    """Smallest unsigned dtype holding every id: uint16 up to 65536 ids (SmolLM's 49152), else uint32."""
    return np.dtype(np.uint16) if vocab <= 2**16 else np.dtype(np.uint32)


def shard_name(i: int) -> str:
    """The tokens file of shard `i`."""
    return f"shard-{i:05d}.bin"


def is_prepared_dir(path: str) -> bool:
    """A directory prepare_data.py made or started (so it is never globbed as raw data files):
    its index, its progress file, or shards it wrote (an index lost after the shards were written)."""
    p = os.path.expanduser(path)
    return os.path.isdir(p) and (
        os.path.exists(os.path.join(p, INDEX))
        or os.path.exists(os.path.join(p, PROGRESS))
        or bool(prepared_leftovers(p))
    )


def prepared_leftovers(path: str) -> list[str]:
    """The shard files prepare_data.py writes that `path` holds (``shard-NNNNN.bin``, and an older
    preparation's ``.doc``)."""
    return sorted(n for n in os.listdir(path) if re.fullmatch(r"shard-\d{5}\.(bin|doc)", n))


def read_index(path: str) -> dict[str, Any]:
    """index.json of prepared directory `path`, with fix-it errors for an unfinished or foreign one."""
    p = os.path.expanduser(path)
    index_file = os.path.join(p, INDEX)
    if not os.path.exists(index_file):
        if os.path.exists(os.path.join(p, PROGRESS)):
            raise DataError(
                f"{p} is an unfinished preparation (no {INDEX}, only {PROGRESS}): scripts/prepare_data.py was "
                "stopped; run it again with the same arguments to finish it"
            )
        if prepared_leftovers(p):
            raise DataError(
                f"{p} holds prepared shards but no {INDEX} (deleted, or lost before the preparation ended): "
                f"run scripts/prepare_data.py again with the same arguments and --out {p} to rebuild it"
            )
        raise DataError(f"{p} has no {INDEX}: it is not a directory made by scripts/prepare_data.py")
    try:
        with open(index_file) as f:
            index = json.load(f)
    except (OSError, ValueError) as err:
        raise DataError(
            f"{index_file} is unreadable ({err}): the index of the shards is lost; delete {p} and run "
            "scripts/prepare_data.py again"
        ) from None
    if index.get("format") != FORMAT or index.get("version", 0) > VERSION:
        raise DataError(
            f"{index_file} is not a nanolight token index of version <= {VERSION} "
            f"(format={index.get('format')!r}, version={index.get('version')!r})"
        )
    return index


def check_shards(path: str, index: dict[str, Any]) -> list[tuple[int, str]]:
    """(shard number, problem) per missing or wrong-sized shard file; [] when all are intact."""
    itemsize = np.dtype(index["dtype"]).itemsize
    problems = []
    for i, shard in enumerate(index["shards"]):
        full, expected = os.path.join(path, shard_name(i)), shard["tokens"] * itemsize
        if not os.path.exists(full):
            problems.append((i, f"{full} is missing"))
        elif os.path.getsize(full) != expected:
            size = os.path.getsize(full)
            problems.append(
                (i, f"{full} has {size} bytes but {INDEX} says {expected} (truncated or damaged)")
            )
    return problems


@dataclass
class PreparedData:
    """An opened prepared directory: its index and the shards as one lazily mapped token stream."""

    path: str
    index: dict[str, Any]
    tokens: TokenShards

    @classmethod
    def open(cls, path: str, key: str = "data.path") -> PreparedData:
        """Open a prepared directory, checked; a missing one names the config `key` that holds it."""
        p = os.path.abspath(os.path.expanduser(path))
        if not os.path.isdir(p):
            raise DataError(
                f"{key}={path!r} is not a directory: name one made by scripts/prepare_data.py --out <dir>"
            )
        index = read_index(p)
        problems = check_shards(p, index)
        if problems:
            raise DataError(
                f"prepared data {p} is damaged: {'; '.join(m for _, m in problems[:4])}. Fix: re-run "
                "scripts/prepare_data.py with the same arguments: it rewrites the damaged shards only"
            )
        return cls(p, index, TokenShards(p, index))

    @property
    def tokenizer(self) -> dict[str, Any]:
        return self.index["tokenizer"]

    @property
    def tokenizer_dir(self) -> str:
        return os.path.join(self.path, "tokenizer")


class TokenShards:
    """The concatenated shards as one read-only token array: `len()` and `[start:stop]` slicing.

    Each shard is memory-mapped on first touch, and `bytes_read` counts the token bytes copied
    out, so a test can check that a dp rank reads only its own samples.
    """

    def __init__(self, path: str, index: dict[str, Any]) -> None:
        self.path, self.dtype = path, np.dtype(index["dtype"])
        # ids the tokenizer cannot have made (a damaged shard, or another tokenizer's): caught as
        # they are read, naming the file, not as an IndexError deep in the model's embedding
        self.vocab = int(index.get("tokenizer", {}).get("vocab_size") or np.iinfo(self.dtype).max + 1)
        sizes = np.array([s["tokens"] for s in index["shards"]], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(sizes)])  # shard i holds [starts[i], starts[i+1])
        self._maps: dict[int, np.ndarray] = {}
        self.bytes_read = 0

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _shard(self, i: int) -> np.ndarray:
        if i not in self._maps:
            self._maps[i] = np.memmap(os.path.join(self.path, shard_name(i)), dtype=self.dtype, mode="r")
        return self._maps[i]

    def __getitem__(self, item: slice) -> np.ndarray:
        start, stop, step = item.indices(len(self))
        if step != 1:
            raise ValueError("TokenShards supports contiguous slices only")
        out = np.empty(max(stop - start, 0), dtype=self.dtype)
        pos = start
        while pos < stop:  # a sample spans at most a few shards
            i = int(np.searchsorted(self.starts, pos, side="right")) - 1
            end = min(stop, int(self.starts[i + 1]))
            piece = out[pos - start : end - start]
            piece[:] = self._shard(i)[pos - self.starts[i] : end - self.starts[i]]
            if piece.size and int(piece.max()) >= self.vocab:
                at = pos - int(self.starts[i]) + int(piece.argmax())
                raise DataError(
                    f"{os.path.join(self.path, shard_name(i))} holds token id {int(piece.max())} (token "
                    f"{at}), past the {self.vocab} ids of its tokenizer: the shard is damaged or from another "
                    "tokenizer; re-run scripts/prepare_data.py for this directory"
                )
            pos = end
        self.bytes_read += out.nbytes
        return out


def write_json(path: str, obj: Any) -> None:
    """Deterministic JSON (sorted keys, no timestamps) written atomically."""
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=True) + "\n")


class ShardWriter:
    """Writes shards into `out`, starting from a committed state (fresh: no shards, nothing open)."""

    def __init__(
        self, out: str, dtype: np.dtype, shard_tokens: int, state: dict[str, Any] | None = None
    ) -> None:
        self.out, self.dtype, self.shard_tokens = out, np.dtype(dtype), shard_tokens
        state = state or {"shards": [], "open": None}
        self.shards: list[dict[str, Any]] = [dict(s) for s in state["shards"]]
        self.open: dict[str, Any] | None = dict(state["open"]) if state["open"] else None
        self._file: BinaryIO | None = None
        self._restore_files()

    def _restore_files(self) -> None:
        """Make the files on disk match the committed state: truncate the open shard, drop later ones."""
        n_kept = len(self.shards) + (1 if self.open else 0)
        for name in prepared_leftovers(self.out):
            if int(name[6:11]) >= n_kept:  # shard-NNNNN.bin / .doc
                os.remove(os.path.join(self.out, name))
        if self.open:
            path, size = (
                os.path.join(self.out, shard_name(len(self.shards))),
                self.open["tokens"] * self.dtype.itemsize,
            )
            if not os.path.exists(path) or os.path.getsize(path) < size:
                raise RuntimeError(
                    f"{path} is shorter than {PROGRESS} records; delete {self.out} and start over"
                )
            os.truncate(path, size)

    def _open_file(self) -> BinaryIO:
        if self._file is None:
            self._file = open(os.path.join(self.out, shard_name(len(self.shards))), "ab")
        return self._file

    def add(self, tokens: np.ndarray, doc_ends: np.ndarray, doc_rows: np.ndarray) -> None:
        """Append documents: `tokens` flat (each document ends with EOS), `doc_ends` their cumulative
        end offsets in `tokens`, `doc_rows` the source row of each."""
        begin = 0  # first document not yet written
        while begin < len(doc_ends):
            if self.open is None:
                first = self.shards[-1]["end_row"] if self.shards else 0  # rows tile the source
                self.open = {"tokens": 0, "documents": 0, "first_row": first, "max_token_id": -1}
            base = int(doc_ends[begin - 1]) if begin else 0
            room = self.shard_tokens - self.open["tokens"]
            # the first document whose end reaches the shard size closes the shard
            last = int(np.searchsorted(doc_ends[begin:] - base, room, side="left")) + begin
            closes = last < len(doc_ends)
            last = min(last, len(doc_ends) - 1)
            piece = tokens[base : doc_ends[last]]
            self._open_file().write(piece.astype(self.dtype, copy=False).tobytes())
            self.open["tokens"] += len(piece)
            if len(piece):
                self.open["max_token_id"] = max(self.open["max_token_id"], int(piece.max()))
            self.open["documents"] += last + 1 - begin
            if closes:
                self._close(end_row=int(doc_rows[last]) + 1)
            begin = last + 1

    def _close(self, end_row: int) -> None:
        self._sync()
        if self._file is not None:
            self._file.close()
            self._file = None
        assert self.open is not None
        self.shards.append({**self.open, "end_row": end_row})
        self.open = None

    def _sync(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    def commit(self, inputs: dict[str, Any], next_row: int) -> None:
        """Make everything written so far durable and record it: the point a restart resumes from."""
        self._sync()
        state = {"inputs": inputs, "next_row": next_row, "shards": self.shards, "open": self.open}
        write_json(os.path.join(self.out, PROGRESS), state)

    def finish(self, index: dict[str, Any], num_rows: int) -> dict[str, Any]:
        """Close the last shard, write index.json (the mark of a complete preparation), drop prepare.json."""
        if self.open is not None:
            self._close(end_row=num_rows)
        full = {**index, "shards": self.shards, "max_token_id": max(s["max_token_id"] for s in self.shards)}
        full["num_tokens"] = sum(s["tokens"] for s in self.shards)
        full["num_documents"] = sum(s["documents"] for s in self.shards)
        write_json(os.path.join(self.out, INDEX), full)
        if os.path.exists(os.path.join(self.out, PROGRESS)):
            os.remove(os.path.join(self.out, PROGRESS))
        return full
