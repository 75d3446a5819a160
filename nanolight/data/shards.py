"""The prepared-data format: token shards plus `index.json`, and its memory-mapped reader.

A directory made by scripts/prepare_data.py holds

    index.json          what is in it: dtype, tokenizer identity and EOS id, source fingerprint,
                        and per shard its file names, token and document counts and source rows
    shard-00000.bin     token ids (uint16, or uint32 for vocabularies above 65536), every
                        document followed by EOS, documents never split across shards
    shard-00000.doc     int64 end offset of every document in the shard (its boundaries)
    tokenizer/          the tokenizer, saved with save_pretrained, so a run needs no hub access

Together the shards are one token stream, packed into `seq_len` samples at read time exactly
like the flat token file, so one preparation serves every `seq_len`. Opening checks every file's
size against the index (a missing or truncated shard is an error naming it) and maps nothing:
a shard is memory-mapped the first time one of this rank's samples touches it.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from nanolight.data.config import DataError

INDEX = "index.json"
PROGRESS = "prepare.json"  # present while a preparation is unfinished
FORMAT = "nanolight-tokens"
VERSION = 1
_REPAIR = "re-run scripts/prepare_data.py with the same arguments: it rewrites the damaged shards only"


def shard_names(i: int) -> tuple[str, str]:
    """(tokens file, document-ends file) of shard `i`."""
    return f"shard-{i:05d}.bin", f"shard-{i:05d}.doc"


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
    """The shard files prepare_data.py writes that `path` holds (``shard-NNNNN.bin`` / ``.doc``)."""
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
        tokens_file, docs_file = shard_names(i)
        for name, expected in (
            (tokens_file, shard["tokens"] * itemsize),
            (docs_file, shard["documents"] * 8),
        ):
            full = os.path.join(path, name)
            if not os.path.exists(full):
                problems.append((i, f"{full} is missing"))
            elif os.path.getsize(full) != expected:
                problems.append(
                    (
                        i,
                        f"{full} has {os.path.getsize(full)} bytes but {INDEX} says {expected} (truncated or damaged)",
                    )
                )
    return problems


@dataclass
class PreparedData:
    """An opened prepared directory: its index and the shards as one lazily mapped token stream."""

    path: str
    index: dict[str, Any]
    tokens: TokenShards

    @classmethod
    def open(cls, path: str) -> PreparedData:
        p = os.path.abspath(os.path.expanduser(path))
        index = read_index(p)
        problems = check_shards(p, index)
        if problems:
            raise DataError(
                f"prepared data {p} is damaged: {'; '.join(m for _, m in problems[:4])}. Fix: {_REPAIR}"
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
        sizes = np.array([s["tokens"] for s in index["shards"]], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(sizes)])  # shard i holds [starts[i], starts[i+1])
        self._maps: dict[int, np.ndarray] = {}
        self.bytes_read = 0

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _shard(self, i: int) -> np.ndarray:
        if i not in self._maps:
            self._maps[i] = np.memmap(os.path.join(self.path, shard_names(i)[0]), dtype=self.dtype, mode="r")
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
            out[pos - start : end - start] = self._shard(i)[pos - self.starts[i] : end - self.starts[i]]
            pos = end
        self.bytes_read += out.nbytes
        return out
