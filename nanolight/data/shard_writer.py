"""Appending tokenized documents to shards, with a commit point that a killed preparation resumes from.

The writer appends documents to the open shard's two files and closes the shard at the first
document end at or past `shard_tokens`, so shard boundaries depend on the token stream alone
(not on chunking, worker count or where a run was killed) and the same inputs give the same
bytes. After each chunk, `commit` flushes and fsyncs the files and then atomically rewrites
prepare.json with the committed sizes and the next source row. Restarting truncates the open
shard back to those sizes, drops any shard begun after them, and goes on from that row.
"""

from __future__ import annotations

import json
import os
from typing import Any, BinaryIO

import numpy as np

from nanolight.data.cache import write_atomically
from nanolight.data.shards import INDEX, PROGRESS, shard_names


def write_json(path: str, obj: Any) -> None:
    """Deterministic JSON (sorted keys, no timestamps) written atomically."""

    def build(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(json.dumps(obj, indent=1, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    write_atomically(path, build)


class ShardWriter:
    """Writes shards into `out`, starting from a committed state (fresh: no shards, nothing open)."""

    def __init__(
        self, out: str, dtype: np.dtype, shard_tokens: int, state: dict[str, Any] | None = None
    ) -> None:
        self.out, self.dtype, self.shard_tokens = out, np.dtype(dtype), shard_tokens
        state = state or {"shards": [], "open": None}
        self.shards: list[dict[str, Any]] = [dict(s) for s in state["shards"]]
        self.open: dict[str, Any] | None = dict(state["open"]) if state["open"] else None
        self._files: tuple[BinaryIO, BinaryIO] | None = None
        self._restore_files()

    def _restore_files(self) -> None:
        """Make the files on disk match the committed state: truncate the open shard, drop later ones."""
        n_kept = len(self.shards) + (1 if self.open else 0)
        i = n_kept
        while any(os.path.exists(os.path.join(self.out, n)) for n in shard_names(i)):
            for name in shard_names(i):
                if os.path.exists(os.path.join(self.out, name)):
                    os.remove(os.path.join(self.out, name))
            i += 1
        if self.open:
            tokens_file, docs_file = (os.path.join(self.out, n) for n in shard_names(len(self.shards)))
            for path, size in (
                (tokens_file, self.open["tokens"] * self.dtype.itemsize),
                (docs_file, self.open["documents"] * 8),
            ):
                if not os.path.exists(path) or os.path.getsize(path) < size:
                    raise RuntimeError(
                        f"{path} is shorter than {PROGRESS} records; delete {self.out} and start over"
                    )
                os.truncate(path, size)

    def _open_files(self) -> tuple[BinaryIO, BinaryIO]:
        if self._files is None:
            names = shard_names(len(self.shards))
            self._files = tuple(open(os.path.join(self.out, n), "ab") for n in names)  # type: ignore[assignment]
        return self._files  # type: ignore[return-value]

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
            piece, ends = tokens[base : doc_ends[last]], doc_ends[begin : last + 1] - base
            tok_f, doc_f = self._open_files()
            tok_f.write(piece.astype(self.dtype, copy=False).tobytes())
            doc_f.write((ends + self.open["tokens"]).astype("<i8").tobytes())
            self.open["tokens"] += len(piece)
            if len(piece):
                self.open["max_token_id"] = max(self.open["max_token_id"], int(piece.max()))
            self.open["documents"] += len(ends)
            if closes:
                self._close(end_row=int(doc_rows[last]) + 1)
            begin = last + 1

    def _close(self, end_row: int) -> None:
        self._sync()
        if self._files is not None:
            for f in self._files:
                f.close()
            self._files = None
        assert self.open is not None
        self.shards.append({**self.open, "end_row": end_row})
        self.open = None

    def _sync(self) -> None:
        if self._files is not None:
            for f in self._files:
                f.flush()
                os.fsync(f.fileno())

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
