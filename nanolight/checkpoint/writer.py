"""Writing one rank's part of a sharded checkpoint, and merging every rank's part into the index.

A rank collects the pieces it owns (`ShardWriter.add`), writes them into its own safetensors
file, fsyncs it and returns the index entries for them (`ShardWriter.write`). Global rank 0
gathers those entries and writes ``index.json`` last (`write_index`): a directory without an
index is never a checkpoint, which is one of the two guarantees of atomicity (the other is the
rename of the whole directory: `save.py`, `atomic.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nanolight.checkpoint.atomic import fsync_path
from nanolight.checkpoint.files import save_tensors
from nanolight.checkpoint.index import INDEX_FILE, CheckpointIndex, Shard, TensorEntry, check_coverage


@dataclass
class RankPart:
    """What one rank wrote: its files' sizes and the index entries (name, global shape, dtype, shard)."""

    files: dict[str, int] = field(default_factory=dict)
    checksums: dict[str, str] = field(default_factory=dict)
    entries: list[tuple[str, list[int], str, dict[str, Any]]] = field(default_factory=list)
    extras: dict[str, Any] = field(default_factory=dict)


class ShardWriter:
    """Collects this rank's pieces per file, then writes each file once (`write`)."""

    def __init__(self, coords: dict[str, int]) -> None:
        self.coords = coords  # {"pp": p, "tp": t, "dp": d}: recorded in each shard
        self._files: dict[str, dict[str, torch.Tensor]] = {}
        self._seen: set[tuple[int, int, int]] = set()
        self.part = RankPart()

    def add(
        self,
        file: str,
        name: str,
        tensor: torch.Tensor,
        global_shape: list[int],
        offset: list[int] | None = None,
        block_shape: list[int] | None = None,
        flat: tuple[int, int] | None = None,
        tp_dim: int | None = None,
    ) -> None:
        """Store `tensor` as the piece of global tensor `name` at `offset` (a block of
        `block_shape`, default: the tensor's own shape), or, with `flat`, as that range of the
        block's flattening. The tensor must be exactly the piece (no copy is made here)."""
        block_shape = list(block_shape if block_shape is not None else tensor.shape)
        offset = list(offset if offset is not None else [0] * len(block_shape))
        expected = flat[1] - flat[0] if flat is not None else math.prod(block_shape)
        if tensor.numel() != expected:
            raise ValueError(f"{name}: piece has {tensor.numel()} elements, the layout says {expected}")
        key = name
        tensor = tensor.detach().contiguous().cpu()
        where = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.numel())
        if where in self._seen:  # the same tensor under two names (ZeRO's per-group `step`)
            tensor = tensor.clone()  # safetensors refuses aliases
        self._seen.add(where)
        self._files.setdefault(file, {})[key] = tensor
        shard = Shard(file, key, offset, block_shape, list(flat) if flat else None, tp_dim, **self.coords)
        dtype = str(tensor.dtype).removeprefix("torch.")
        self.part.entries.append((name, list(global_shape), dtype, dict(vars(shard))))

    def add_extra(self, name: str, value: Any) -> None:
        """A non-tensor value (e.g. SGD's ``momentum_buffer=None``), kept in the index as JSON."""
        self.part.extras[name] = value

    def write(self, directory: Path) -> RankPart:
        """Write and fsync this rank's files; return its part of the index."""
        for file, tensors in self._files.items():
            path = Path(directory) / file
            self.part.checksums[file] = save_tensors(path, tensors)
            self.part.files[file] = path.stat().st_size
        return self.part


def merge_parts(parts: list[RankPart], topology: dict[str, Any], aliases: dict[str, str]) -> CheckpointIndex:
    """Every rank's entries -> one index (checked: each global tensor stored exactly once)."""
    tensors: dict[str, TensorEntry] = {}
    files: dict[str, int] = {}
    extras: dict[str, Any] = {}
    checksums: dict[str, str] = {}
    for part in parts:
        files.update(part.files)
        extras.update(part.extras)
        checksums.update(part.checksums)
        for name, shape, dtype, shard in part.entries:
            entry = tensors.setdefault(name, TensorEntry(shape, dtype))
            if entry.shape != shape or entry.dtype != dtype:
                raise RuntimeError(
                    f"ranks disagree about {name}: {entry.shape}/{entry.dtype} vs {shape}/{dtype}"
                )
            entry.shards.append(Shard(**shard))
    index = CheckpointIndex(topology, dict(sorted(tensors.items())), files, aliases, extras, checksums)
    check_coverage(index)
    return index


def write_index(directory: Path, index: CheckpointIndex) -> None:
    path = Path(directory) / INDEX_FILE
    path.write_text(index.to_json())
    fsync_path(path)
