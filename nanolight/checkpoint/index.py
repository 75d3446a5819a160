"""The checkpoint index: what every file holds and how it maps to global tensors.

Why an index: each rank writes only the tensors (or slices of tensors) it owns, so no file is
a whole model. The index is the one place that says, for every *global* tensor (the tensor a
single-device run would hold), its shape, dtype and where each piece lives:

    "model/model.layers.0.self_attn.qkv_proj.weight": {
        "shape": [192, 64], "dtype": "float32",
        "shards": [{"file": "model-pp00-tp00.safetensors", "key": "...",
                    "offset": [0, 0], "shape": [96, 64], "flat": null,
                    "tp_dim": 0, "pp": 0, "tp": 0, "dp": 0}, ...]}

A shard is a rectangular block (`offset`, `shape`) of the global tensor -- tensor parallelism
cuts along `tp_dim` -- or, with `flat` = [start, end), only that range of the block's row-major
flattening: ZeRO-1 partitions the flattened (tp-local) parameters over dp ranks, so a dp rank's
optimizer state is a flat piece of a block. `pp`/`tp`/`dp` record who wrote it (informational:
loading only needs the geometry, which is what makes a checkpoint loadable at any topology).

Names: ``model/<module state_dict key>`` for weights, ``optim/<k>/<param state_dict key>/<state
key>`` for optimizer k's per-parameter state (Adam's ``exp_avg``, ``exp_avg_sq``, ``step``).
`aliases` maps a tied name (``model/model.lm_head.weight``) to the stored one. `files` records
every file's byte size and CRC-32, so a truncated, missing or damaged file is found before its
tensors are used. (One process writes the same index, one shard per tensor; `reader.py` builds
one in memory for a directory without it.)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanolight.checkpoint.atomic import CheckpointError

INDEX_FILE = "index.json"
# v2: the MLP's gate_up rows are stored [gate | up] (v1: interleaved per unit); a v1 checkpoint
# converts once with scripts/upgrade_checkpoint.py
FORMAT, FORMAT_V1 = "nanolight-sharded-v2", "nanolight-sharded-v1"
UPGRADE_HINT = "convert it once with `python scripts/upgrade_checkpoint.py {path} NEW` and resume from NEW"


@dataclass
class Shard:
    """One stored piece of a global tensor (see the module docstring)."""

    file: str
    key: str
    offset: list[int]
    shape: list[int]
    flat: list[int] | None = None  # [start, end) of the block's flattening, or the whole block
    tp_dim: int | None = None
    pp: int = 0
    tp: int = 0
    dp: int = 0

    @property
    def numel(self) -> int:
        return self.flat[1] - self.flat[0] if self.flat is not None else math.prod(self.shape)


@dataclass
class TensorEntry:
    shape: list[int]
    dtype: str
    shards: list[Shard] = field(default_factory=list)


@dataclass
class CheckpointIndex:
    """The parsed ``index.json`` of one checkpoint directory."""

    topology: dict[str, Any]
    tensors: dict[str, TensorEntry]
    files: dict[str, int]  # file name -> size in bytes, as written
    aliases: dict[str, str] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)  # non-tensor optimizer state (e.g. None)
    checksums: dict[str, str] = field(default_factory=dict)  # file name -> CRC-32, as written
    format: str = FORMAT

    def to_json(self) -> str:
        # by hand, not dataclasses.asdict: its deep copy cost 50 ms per save at 600 tensors
        tensors = {
            name: {"shape": e.shape, "dtype": e.dtype, "shards": [vars(s) for s in e.shards]}
            for name, e in self.tensors.items()
        }
        header = {k: v for k, v in vars(self).items() if k != "tensors"}
        return (
            json.dumps({**header, "tensors": tensors}, separators=(",", ":")) + "\n"
        )  # `python -m json.tool`

    @classmethod
    def from_json(cls, text: str, where: Path) -> CheckpointIndex:
        try:
            raw = json.loads(text)
            if raw.get("format") == FORMAT_V1:
                raise CheckpointError(
                    f"{where.parent} is a checkpoint of format v1 (the MLP's gate_up rows interleaved): "
                    + UPGRADE_HINT.format(path=where.parent)
                )
            if isinstance(raw.get("format"), str) and raw["format"] != FORMAT:  # another tool's index
                raise CheckpointError(
                    f"{where.parent} is not a checkpoint directory: its {where.name} is a "
                    f"{raw['format']!r} index, not a checkpoint's; name a checkpoint (a step-N directory "
                    "under a run's checkpoints/, or `last`)"
                )
            if raw.get("format") != FORMAT:
                raise ValueError(f"format is {raw.get('format')!r}, expected {FORMAT!r}")
            tensors = {
                name: TensorEntry(e["shape"], e["dtype"], [Shard(**s) for s in e["shards"]])
                for name, e in raw["tensors"].items()
            }
            return cls(**{**raw, "tensors": tensors})  # no "checksums" in indexes written before them
        except CheckpointError:
            raise
        except (ValueError, KeyError, TypeError) as exc:  # JSONDecodeError is a ValueError
            raise CheckpointError(
                f"checkpoint index {where} is unreadable ({exc}); the save did not finish or the file "
                "was damaged -- resume from an earlier checkpoint"
            ) from exc

    def resolve(self, name: str) -> str:
        """The stored name for `name` (itself, or what a tied alias points at)."""
        return self.aliases.get(name, name)
