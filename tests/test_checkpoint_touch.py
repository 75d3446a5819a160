"""At resume each rank touches only the files it reads: a checkpoint of 4 tp shards, read back by
4 ranks of the same layout, each asking for its own rows -- every ``os.stat`` and ``open`` on the
checkpoint's files counted per rank. (At 4,096 ranks a stat of every file by every rank is 16
million metadata calls on the shared file system before the first tensor.)"""

from __future__ import annotations

import builtins
import os
from pathlib import Path

import pytest
import torch

from nanolight.checkpoint.atomic import CheckpointError
from nanolight.checkpoint.index import INDEX_FILE
from nanolight.checkpoint.reader import CheckpointReader
from nanolight.checkpoint.save import ShardWriter, merge_parts, write_index

RANKS, ROWS, COLS = 4, 8, 3


def _write(directory: Path) -> torch.Tensor:
    full = torch.arange(RANKS * ROWS * COLS, dtype=torch.float32).view(RANKS * ROWS, COLS)
    parts = []
    for r in range(RANKS):
        writer = ShardWriter({"pp": 0, "tp": r, "dp": 0})
        rows = full[r * ROWS : (r + 1) * ROWS]
        writer.add(f"model-tp{r}.safetensors", "model/w", rows, list(full.shape), [r * ROWS, 0], tp_dim=0)
        parts.append(writer.write(directory))
    write_index(directory, merge_parts(parts, {"tp": RANKS, "pp": 1, "dp": 1, "world_size": RANKS}, {}))
    return full


def _touched(directory: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts `os.stat` and `open` calls on files of `directory`, by file name, from now on."""
    counts: dict[str, int] = {}
    real_stat, real_open = os.stat, builtins.open

    def note(path: object) -> None:
        if isinstance(path, (str, os.PathLike)) and Path(path).parent == directory:
            counts[Path(path).name] = counts.get(Path(path).name, 0) + 1

    def stat(path, *args, **kwargs):  # noqa: ANN001, ANN202 - os.stat's own signature
        note(path)
        return real_stat(path, *args, **kwargs)

    def open_(path, *args, **kwargs):  # noqa: ANN001, ANN202
        note(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    monkeypatch.setattr(builtins, "open", open_)
    return counts


@pytest.mark.parametrize("rank", range(RANKS))
def test_each_rank_touches_only_the_index_and_its_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rank: int
) -> None:
    full = _write(tmp_path)
    counts = _touched(tmp_path, monkeypatch)
    reader = CheckpointReader.open(tmp_path)
    mine = reader.read("model/w", [rank * ROWS, 0], [ROWS, COLS])
    monkeypatch.undo()
    assert torch.equal(mine, full[rank * ROWS : (rank + 1) * ROWS])
    assert set(counts) == {INDEX_FILE, f"model-tp{rank}.safetensors"}, counts


def test_a_damaged_shard_is_named_when_its_rank_reads_it(tmp_path: Path) -> None:
    _write(tmp_path)
    shard = tmp_path / "model-tp2.safetensors"
    shard.write_bytes(shard.read_bytes()[:-8])
    reader = CheckpointReader.open(tmp_path)
    assert reader.read("model/w", [0, 0], [ROWS, COLS]).shape == (ROWS, COLS)  # rank 0 needs no tp2
    with pytest.raises(CheckpointError, match=r"model-tp2\.safetensors is truncated or damaged"):
        reader.read("model/w", [2 * ROWS, 0], [ROWS, COLS])
