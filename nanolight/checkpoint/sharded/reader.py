"""Reading any block of any global tensor from a sharded checkpoint, at any topology.

A loading rank asks for exactly what it will hold -- e.g. rows [96, 192) of a qkv weight at
tp=2, or the whole tensor at tp=1 -- and `ShardedReader.read` assembles it from whichever
stored shards overlap, reading only those rows/columns of unflattened shards (safetensors
slices are read from the memory-mapped file). ZeRO-1 pieces are flat ranges of a block, so
their block is first rebuilt from the flat pieces of every dp rank that wrote one.

Every file named in the index is checked up front (exists, byte size as written): a missing
or truncated shard is an error naming the file before any tensor is read.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from nanolight.checkpoint.sharded.index import INDEX_FILE, CheckpointIndex, Shard


def is_sharded_checkpoint(path: str | Path) -> bool:
    return (Path(path) / INDEX_FILE).is_file()


class ShardedReader:
    """Validated, read-only view of a sharded checkpoint directory."""

    def __init__(self, path: str | Path, verify: str = "") -> None:
        """`verify`: check only the files holding tensors whose names start with it (e.g.
        ``"model/"`` to convert the weights even if an optimizer shard was lost); "" checks all."""
        self.path = Path(path)
        index_file = self.path / INDEX_FILE
        if not index_file.is_file():
            raise FileNotFoundError(
                f"{self.path} has no {INDEX_FILE}: not a complete sharded checkpoint (an interrupted save "
                "leaves no index); resume from `last` or an earlier step directory"
            )
        self.index = CheckpointIndex.from_json(index_file.read_text(), index_file)
        self._check_files(verify)
        self._handles: dict[str, Any] = {}

    def _check_files(self, prefix: str) -> None:
        needed = None
        if prefix:
            needed = {s.file for n, e in self.index.tensors.items() if n.startswith(prefix) for s in e.shards}
        for file, size in self.index.files.items():
            if needed is not None and file not in needed:
                continue
            path = self.path / file
            if not path.is_file():
                raise FileNotFoundError(
                    f"checkpoint shard {path} is missing (the index lists it); the checkpoint is incomplete "
                    "-- restore the file or resume from an earlier checkpoint"
                )
            actual = path.stat().st_size
            if actual != size:
                raise ValueError(
                    f"checkpoint shard {path} is truncated or damaged: {actual} bytes, {size} were written; "
                    "restore the file or resume from an earlier checkpoint"
                )

    @property
    def topology(self) -> dict[str, Any]:
        return dict(self.index.topology)

    def names(self, prefix: str = "") -> list[str]:
        """Stored tensor names (and aliases) starting with `prefix`."""
        names = [n for n in self.index.tensors if n.startswith(prefix)]
        return sorted(names + [a for a in self.index.aliases if a.startswith(prefix)])

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name).shape)

    def _entry(self, name: str) -> Any:
        stored = self.index.resolve(name)
        if stored not in self.index.tensors:
            raise KeyError(f"checkpoint {self.path} holds no tensor {name!r}")
        return self.index.tensors[stored]

    def _handle(self, file: str) -> Any:
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(self.path / file), framework="pt")
            except Exception as exc:  # safetensors raises its own error type for a bad header
                raise ValueError(f"checkpoint shard {self.path / file} is unreadable ({exc})") from exc
        return self._handles[file]

    def read(
        self, name: str, offset: list[int] | None = None, shape: list[int] | None = None
    ) -> torch.Tensor:
        """The block [offset, offset + shape) of global tensor `name` (default: all of it), on CPU."""
        entry = self._entry(name)
        shape = list(shape if shape is not None else entry.shape)
        offset = list(offset if offset is not None else [0] * len(shape))
        if any(o < 0 or o + s > g for o, s, g in zip(offset, shape, entry.shape, strict=True)):
            raise ValueError(f"{name}: block {offset}+{shape} is outside the stored shape {entry.shape}")
        whole = [s for s in entry.shards if s.flat is None and s.offset == offset and s.shape == shape]
        if whole:  # exactly one stored block (same topology): no assembly, no extra copy
            return self._get(whole[0])
        out = torch.empty(shape, dtype=getattr(torch, entry.dtype))
        filled = 0
        for block_offset, block_shape, shards in _blocks(entry.shards):
            lo = [max(a, b) for a, b in zip(offset, block_offset, strict=True)]
            hi = [
                min(a + s, b + t) for a, s, b, t in zip(offset, shape, block_offset, block_shape, strict=True)
            ]
            if any(h <= x for x, h in zip(lo, hi, strict=True)):
                continue  # no overlap
            src = tuple(slice(x - b, h - b) for x, h, b in zip(lo, hi, block_offset, strict=True))
            dst = tuple(slice(x - o, h - o) for x, h, o in zip(lo, hi, offset, strict=True))
            out[dst] = self._read_block_part(block_shape, shards, src, out.dtype)
            filled += math.prod(h - x for x, h in zip(lo, hi, strict=True))
        if filled != math.prod(shape):
            raise ValueError(f"checkpoint {self.path}: the shards of {name} do not cover {offset}+{shape}")
        return out

    def _read_block_part(
        self, block_shape: list[int], shards: list[Shard], src: tuple, dtype: torch.dtype
    ) -> torch.Tensor:
        if len(shards) == 1 and shards[0].flat is None:  # a whole block: read just the slice
            shard = shards[0]
            return self._handle(shard.file).get_slice(shard.key)[src] if src else self._get(shard)
        # ZeRO-1: flat pieces of the block from several dp ranks. Read only the pieces (and the
        # parts of them) overlapping the flat extent of the requested region.
        row = math.prod(block_shape[1:]) if block_shape else 1
        full_rows = all(s == slice(0, n) for s, n in zip(src[1:], block_shape[1:], strict=True))
        lo, hi = (src[0].start * row, src[0].stop * row) if src and full_rows else (0, math.prod(block_shape))
        buf = torch.empty(hi - lo, dtype=dtype)
        for shard in shards:
            start, end = shard.flat if shard.flat is not None else (0, math.prod(block_shape))
            a, b = max(start, lo), min(end, hi)
            if a < b:
                buf[a - lo : b - lo] = self._handle(shard.file).get_slice(shard.key)[a - start : b - start]
        if lo == 0 and hi == math.prod(block_shape):
            return buf.view(block_shape)[src]
        return buf.view(-1, *block_shape[1:])  # exactly the requested rows

    def _get(self, shard: Shard) -> torch.Tensor:
        try:
            return self._handle(shard.file).get_tensor(shard.key)
        except Exception as exc:
            raise ValueError(f"checkpoint shard {self.path / shard.file} is unreadable ({exc})") from exc

    def extra(self, name: str, default: Any = None) -> Any:
        return self.index.extras.get(name, default)

    def model_state(self, strip_prefix: str = "") -> dict[str, torch.Tensor]:
        """Every model tensor in full, keyed by state-dict name (minus `strip_prefix`), aliases
        included (a tied lm_head shares the embedding's tensor)."""
        out: dict[str, torch.Tensor] = {}
        full: dict[str, torch.Tensor] = {}
        for name in self.names("model/"):
            key = name.removeprefix("model/")
            if not key.startswith(strip_prefix):
                continue
            stored = self.index.resolve(name)
            if stored not in full:
                full[stored] = self.read(stored)
            out[key.removeprefix(strip_prefix)] = full[stored]
        return out

    def close(self) -> None:
        self._handles.clear()


def _blocks(shards: list[Shard]) -> list[tuple[list[int], list[int], list[Shard]]]:
    """Group shards by the block they belong to (ZeRO pieces of one block share it)."""
    groups: dict[tuple, tuple[list[int], list[int], list[Shard]]] = {}
    for shard in shards:
        key = (tuple(shard.offset), tuple(shard.shape))
        groups.setdefault(key, (shard.offset, shard.shape, []))[2].append(shard)
    return list(groups.values())


def read_model_state(path: str | Path, strip_prefix: str = "") -> dict[str, torch.Tensor]:
    """Full model tensors of a sharded checkpoint (see `ShardedReader.model_state`)."""
    return ShardedReader(path).model_state(strip_prefix)
