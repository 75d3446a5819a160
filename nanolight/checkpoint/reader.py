"""Reading any block of any global tensor of a checkpoint directory, whatever layout wrote it.

One format: an ``index.json`` (`index.py`) says where every piece of every global tensor lives,
whether tp x pp x dp ranks wrote it or one process (the one-shard case). A loading rank asks for
exactly what it will hold -- rows [96, 192) of a qkv weight at tp=2, or the whole tensor on one
device -- and `read` assembles it from whichever stored shards overlap, reading only those
rows/columns (safetensors slices come from the memory-mapped file). ZeRO-1 pieces are flat ranges
of a block; their block is rebuilt from the pieces that overlap.

Plus one read path without an index, kept for what has none: a model directory's one
``model.safetensors`` (`pretrained.py`; a Hugging Face model's files too, for conversion). The
same index is built for it in memory (every tensor one whole shard), so it is read and resharded
the same way. A one-process training checkpoint written before the format was one is not read:
``scripts/upgrade_checkpoint.py`` converts it once, and opening it says so.

Each file is checked when this rank first opens it -- there, as large as written, the same CRC-32
(damage that keeps the size) -- so a missing or damaged shard is an error naming the file. Only
the files a rank reads are touched: at resume a rank of a 4,096-rank run opens the index and its
few shards, never stats the other thousands. `verify_all` checks every file: `newest_intact` asks
it of each candidate when a checkpoint turns out damaged, so the error can name the newest whole
one to resume from.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch

from nanolight.checkpoint.atomic import (
    CheckpointError,
    MissingCheckpointFile,
    load_json,
    load_torch,
    open_tensors,
    verify,
)
from nanolight.checkpoint.index import INDEX_FILE, UPGRADE_HINT, CheckpointIndex, Shard, TensorEntry

TRAINER_FILE, CONFIG_FILE = "trainer_state.pt", "config.json"
GROUPS_FILE = "optimizer_groups.pt"  # every optimizer's param-group hyperparameters
WEIGHTS_FILE = "model.safetensors"  # no index: a model directory's
HF_INDEX = "model.safetensors.index.json"  # a Hugging Face model's weights in several files
SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


_STEP = re.compile(r"(?:^|[-_])step[-=](\d+)")  # step-12, epoch=0-step=12, ...-step=12-...


def is_sharded_checkpoint(path: str | Path) -> bool:
    return (Path(path) / INDEX_FILE).is_file()


def stored_model_prefix(path: str | Path) -> str:
    """The key prefix of the model's tensors in a nanolight directory ("" in a model directory,
    the module attribute in a training step directory, as its config.json says)."""
    cfg_file = Path(path) / CONFIG_FILE
    sharding = load_json(cfg_file, "model config").get("sharding") if cfg_file.is_file() else None
    return (sharding.get("prefix") or "") if isinstance(sharding, dict) else ""


class CheckpointReader:
    """Validated, read-only view of a checkpoint directory. Open it with `CheckpointReader.open`."""

    def __init__(self, path: Path, index: CheckpointIndex, indexed: bool) -> None:
        self.path, self.index, self.indexed = path, index, indexed  # indexed: per-rank files too
        self._handles: dict[str, Any] = {}
        self._verified: set[str] = set()

    @classmethod
    def open(cls, path: str | Path) -> CheckpointReader:
        """The checkpoint directory at `path` (its index read; no shard touched yet)."""
        path = Path(path)
        if is_sharded_checkpoint(path):  # the format
            index_file = path / INDEX_FILE
            text = index_file.read_text(errors="replace")  # not UTF-8: from_json names the file
            return cls(path, CheckpointIndex.from_json(text, index_file), True)
        if (path / WEIGHTS_FILE).is_file() and (path / TRAINER_FILE).is_file():  # the old one-process format
            raise CheckpointError(
                f"{path} is a one-process checkpoint of the format before the index (nanolight 0.1): "
                + UPGRADE_HINT.format(path=path)
            )
        if (path / WEIGHTS_FILE).is_file() or (path / HF_INDEX).is_file():  # no index: build it in memory
            index = CheckpointIndex({"tp": 1, "pp": 1, "dp": 1, "world_size": 1}, {}, {})
            return cls(path, index, False)._index_weights()
        saved = (
            [p.name for p in path.iterdir() if p.suffix in (".safetensors", ".pt")] if path.is_dir() else []
        )
        if not saved:  # not even part of a save: another kind of directory
            raise MissingCheckpointFile(
                f"{path} is not a checkpoint directory (no {INDEX_FILE}, no weights): name a checkpoint (a "
                "step-N directory under a run's checkpoints/, or `last`) or a model directory"
            )
        raise MissingCheckpointFile(
            f"{path} has no {INDEX_FILE}: not a complete checkpoint (an interrupted save leaves no "
            f"index), nor a model directory ({WEIGHTS_FILE}); resume from an earlier checkpoint"
        )

    # ---- the in-memory index of a directory without one ---------------------------------------
    def _index_weights(self) -> CheckpointReader:
        hf_index = self.path / HF_INDEX
        weight_map = load_json(hf_index, "weights index")["weight_map"] if hf_index.is_file() else {}
        for file in sorted(set(weight_map.values())) or [WEIGHTS_FILE]:
            handle = self._handle(file)
            for key in handle.keys():  # noqa: SIM118 (a safetensors handle is not a dict)
                part = handle.get_slice(key)
                dtype = SAFETENSORS_DTYPES[part.get_dtype()]
                self._add_whole(f"model/{key}", file, key, list(part.get_shape()), dtype)
        return self

    def _add_whole(self, name: str, file: str, key: str, shape: list[int], dtype: str) -> None:
        shard = Shard(file, key, [0] * len(shape), shape)
        self.index.tensors[name] = TensorEntry(shape, dtype, [shard])

    # ---- what is stored --------------------------------------------------------------------------
    @property
    def topology(self) -> dict[str, Any]:
        return dict(self.index.topology)

    def names(self, prefix: str = "") -> list[str]:
        """Stored tensor names (and aliases) starting with `prefix`."""
        names = [n for n in self.index.tensors if n.startswith(prefix)]
        return sorted(names + [a for a in self.index.aliases if a.startswith(prefix)])

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name).shape)

    def _entry(self, name: str) -> TensorEntry:
        stored = self.index.resolve(name)
        if stored not in self.index.tensors:
            raise KeyError(f"checkpoint {self.path} holds no tensor {name!r}")
        return self.index.tensors[stored]

    def optimizer_groups(self) -> list[list[dict[str, Any]]]:
        """Every optimizer's param-group hyperparameters (without the parameters), as saved."""
        if not self.indexed:
            return []
        there = (self.path / GROUPS_FILE).exists()
        return load_torch(self._checked(GROUPS_FILE), "optimizer hyperparameters") if there else []

    def trainer_state(self) -> dict[str, Any]:
        """Progress, schedulers, callbacks, loop position and RNG, as the trainer saved them."""
        file = self.path / TRAINER_FILE
        return load_torch(self._checked(TRAINER_FILE), "trainer state") if file.exists() else {}

    def rank_state(self, rank: int) -> dict[str, Any]:
        """An indexed checkpoint's per-rank part: that rank's RNG states and data position."""
        return load_torch(self._checked(f"rank-{rank:05d}.pt"), "rank state")

    # ---- reading -------------------------------------------------------------------------------
    def _checked(self, file: str) -> Path:
        """`file`'s path, once verified against the size and CRC-32 recorded when it was written."""
        if file not in self._verified:
            verify(self.path / file, self.index.files.get(file), self.index.checksums.get(file))
            self._verified.add(file)
        return self.path / file

    def _handle(self, file: str) -> Any:
        if file not in self._handles:
            self._handles[file] = open_tensors(self._checked(file))
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
            return self._handle(whole[0].file).get_tensor(whole[0].key)
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
            raise CheckpointError(
                f"checkpoint {self.path}: the shards of {name} do not cover {offset}+{shape}"
            )
        return out

    def _read_block_part(
        self, block_shape: list[int], shards: list[Shard], src: tuple, dtype: torch.dtype
    ) -> torch.Tensor:
        if len(shards) == 1 and shards[0].flat is None:  # a whole block: read just the slice
            shard = shards[0]
            handle = self._handle(shard.file)
            return handle.get_slice(shard.key)[src] if src else handle.get_tensor(shard.key)
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

    def verify_all(self) -> None:
        """Open every file (size and checksum where indexed, else its header); a damaged one raises."""
        index = self.index
        for file in sorted(set(index.files) | {s.file for e in index.tensors.values() for s in e.shards}):
            self._checked(file) if file in index.files else self._handle(file)
        self.trainer_state()

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


def _blocks(shards: list[Shard]) -> list[tuple[list[int], list[int], list[Shard]]]:
    """Group shards by the block they belong to (ZeRO pieces of one block share it)."""
    groups: dict[tuple, tuple[list[int], list[int], list[Shard]]] = {}
    for shard in shards:
        key = (tuple(shard.offset), tuple(shard.shape))
        groups.setdefault(key, (shard.offset, shard.shape, []))[2].append(shard)
    return list(groups.values())


def is_intact(path: str | Path) -> bool:
    """Every file of checkpoint `path` is there, as large as written and with its checksum (an
    index from before checksums: every file opens)."""
    try:
        CheckpointReader.open(path).verify_all()
    except (CheckpointError, OSError, ValueError):
        return False
    return True


def newest_intact(parent: Path, exclude: Path | None = None) -> Path | None:
    """The newest checkpoint under `parent` (other than `exclude`) that `is_intact`, by the step in
    its name: the recipe's ``step-<N>``, Lightning's ``epoch=<E>-step=<N>`` or a template's. Asked
    only when a checkpoint is damaged (it opens every file)."""
    steps = {p: int(m[-1]) for p in Path(parent).iterdir() if p.is_dir() and (m := _STEP.findall(p.name))}
    for step in sorted(steps, key=lambda p: steps[p], reverse=True):
        if (exclude is None or step.resolve() != Path(exclude).resolve()) and is_intact(step):
            return step
    return None
