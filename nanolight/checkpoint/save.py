"""Writing a training checkpoint directory: every rank's shards, then one index.

One process is the one-shard case of the same format: its one "rank" stores every tensor whole.
Who writes what -- each global tensor exactly once, which `merge_parts` checks -- is
`ModelLayout.stores`: dp rank 0 of every (pp, tp) writes its tp block of its stage's weights; a
tp-replicated tensor only tp rank 0; a tensor two stages hold (the tied embedding) only the lowest
stage; an alias (a tied ``lm_head.weight``) nothing. The optimizer state follows the same rules,
except that with ZeRO-1 every dp rank writes its flat partition, and scalars such as Adam's
``step`` come from the holder of the parameter's first element. Every rank also writes
``rank-<R>.pt`` (its RNG states and data position).

The protocol: rank 0 makes ``.tmp-step-N``; every rank writes and fsyncs its files there; all
ranks agree that every write succeeded (one all_reduce: a rank that failed, e.g. on a full disk,
makes every rank raise, no one hangs, nothing is published); rank 0 gathers the index entries,
writes ``index.json`` last (a directory without an index is never a checkpoint), and renames the
directory into place (`atomic.publish`). The trainer moves ``last`` only after this returns.

A module holding a model with a `directory_config()` (`HasDirectoryConfig`: the Llama of `models/` does)
also gets a ``config.json``, so the step directory is a model directory (`load_pretrained`, export to
Hugging Face); what a run adds to an export (its tokenizer, its HF token ids) is handed in as
`ExportExtras` by whoever builds the strategy (the recipe).
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from nanolight.checkpoint.atomic import (
    CheckpointError,
    fsync_path,
    publish,
    remove_stale,
    save_tensors,
    save_torch,
    temp_dir_for,
)
from nanolight.checkpoint.index import INDEX_FILE, CheckpointIndex, Shard, TensorEntry
from nanolight.checkpoint.reader import CONFIG_FILE, GROUPS_FILE, TRAINER_FILE

# a model directory's config.json says so; 2: the MLP's gate_up rows [gate | up] (1: interleaved)
FORMAT_NAME, FORMAT_VERSION = "nanolight", 2


@runtime_checkable
class HasDirectoryConfig(Protocol):
    """A model whose checkpoints are also model directories: it gives ``config.json``'s fields."""

    def directory_config(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class ExportExtras:
    """What a run adds to each checkpoint so that it exports complete: the files `names` found in
    `directory` at each save (a tokenizer, written once the run starts), copied in, and `config`,
    keys added to ``config.json``. Given to the strategy by the recipe; none by default."""

    directory: Path | None = None
    names: tuple[str, ...] = ()
    config: dict[str, Any] = field(default_factory=dict)

    def copy_into(self, target: Path) -> None:
        """Copy the files `names` found in `directory` into `target` (fsynced)."""
        for name in self.names:
            if self.directory is not None and (Path(self.directory) / name).is_file():
                shutil.copyfile(Path(self.directory) / name, Path(target) / name)
                fsync_path(Path(target) / name)


def write_config(
    directory: Path, fields: dict[str, Any], sharding: dict[str, str] | None, extra: dict[str, Any]
) -> None:
    """A model directory's ``config.json``: the model's `fields`, this format's tags, where its
    tensors are (`sharding`; null: one ``model.safetensors``) and what the run adds (`extra`)."""
    tags = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "sharding": sharding}
    path = Path(directory) / CONFIG_FILE
    path.write_text(json.dumps({**fields, **tags, **extra}, indent=2) + "\n")
    fsync_path(path)


# ---- one rank's part ---------------------------------------------------------------------------
@dataclass
class RankPart:
    """What one rank wrote: its files' sizes and the index entries (name, global shape, dtype, shard)."""

    files: dict[str, int] = field(default_factory=dict)
    checksums: dict[str, str] = field(default_factory=dict)
    entries: list[tuple[str, list[int], str, dict[str, Any]]] = field(default_factory=list)
    extras: dict[str, Any] = field(default_factory=dict)

    def record(self, path: Path, crc32: str) -> None:
        """File `path` was written, fsynced, with this CRC-32: the index records its size and CRC."""
        self.files[path.name], self.checksums[path.name] = path.stat().st_size, crc32


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
        key: str | None = None,
    ) -> None:
        """Store `tensor` as the piece of global tensor `name` at `offset` (a block of
        `block_shape`, default: the tensor's own shape), or, with `flat`, as that range of the
        block's flattening, under `key` in the file (default: `name`; a rank holding two blocks of
        one tensor names each). The tensor must be exactly the piece (no copy is made here)."""
        block_shape = list(block_shape if block_shape is not None else tensor.shape)
        offset = list(offset if offset is not None else [0] * len(block_shape))
        expected = flat[1] - flat[0] if flat is not None else math.prod(block_shape)
        if tensor.numel() != expected:
            raise ValueError(f"{name}: piece has {tensor.numel()} elements, the layout says {expected}")
        tensor = tensor.detach().contiguous().cpu()
        where = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.numel())
        if where in self._seen:  # the same tensor under two names (ZeRO's per-group `step`)
            tensor = tensor.clone()  # safetensors refuses aliases
        self._seen.add(where)
        key = key or name
        self._files.setdefault(file, {})[key] = tensor
        shard = Shard(file, key, offset, block_shape, list(flat) if flat else None, tp_dim, **self.coords)
        dtype = str(tensor.dtype).removeprefix("torch.")
        self.part.entries.append((name, list(global_shape), dtype, dict(vars(shard))))

    def add_value(self, file: str, name: str, value: Any) -> None:
        """A whole tensor, or a plain value (e.g. SGD's ``momentum_buffer=None``) kept in the index."""
        if isinstance(value, torch.Tensor):
            self.add(file, name, value, list(value.shape))
        elif value is None or isinstance(value, bool | int | float | str):
            self.part.extras[name] = value
        else:
            raise TypeError(
                f"optimizer state {name} is a {type(value).__name__}: only tensors and plain values are saved"
            )

    def write(self, directory: Path) -> RankPart:
        """Write and fsync this rank's files; return its part of the index."""
        for file, tensors in self._files.items():
            path = Path(directory) / file
            self.part.record(path, save_tensors(path, tensors))
        return self.part


def merge_parts(parts: list[RankPart], topology: dict[str, Any], aliases: dict[str, str]) -> CheckpointIndex:
    """Every rank's entries -> one index (checked: each global tensor stored exactly once)."""
    index = CheckpointIndex(topology, {}, {}, aliases)
    for part in parts:
        index.files.update(part.files)
        index.extras.update(part.extras)
        index.checksums.update(part.checksums)
        for name, shape, dtype, shard in part.entries:
            entry = index.tensors.setdefault(name, TensorEntry(shape, dtype))
            if entry.shape != shape or entry.dtype != dtype:
                raise RuntimeError(
                    f"ranks disagree about {name}: {entry.shape}/{entry.dtype} vs {shape}/{dtype}"
                )
            entry.shards.append(Shard(**shard))
    index.tensors = dict(sorted(index.tensors.items()))
    # each global tensor stored exactly once: a cheap self-check of the ownership rules (`stores`),
    # whose bug would otherwise surface only when a later run loads zeros or fails
    bad = [
        f"{n}: {sum(s.numel for s in e.shards)} of {math.prod(e.shape)} elements"
        for n, e in index.tensors.items()
        if sum(s.numel for s in e.shards) != math.prod(e.shape)
    ]
    if bad:
        raise RuntimeError(f"sharded checkpoint would be incomplete: {', '.join(bad[:5])}")
    return index


def write_index(directory: Path, index: CheckpointIndex) -> None:
    path = Path(directory) / INDEX_FILE
    path.write_text(index.to_json())
    fsync_path(path)


def _file(kind: str, coords: dict[str, int]) -> str:
    name = f"{kind}-pp{coords['pp']:02d}-tp{coords['tp']:02d}"
    return f"{name}-dp{coords['dp']:02d}.safetensors" if kind == "optim" else f"{name}.safetensors"


def _whole_pieces(opt: Any) -> Iterator[tuple[nn.Parameter, int, int, dict[str, Any]]]:
    """A plain optimizer's state as `ZeroOptimizer.local_state_pieces` gives it: whole params."""
    params = [p for g in opt.param_groups for p in g["params"]]
    for idx, entry in opt.state_dict()["state"].items():
        p = params[int(idx)]
        yield p, 0, p.numel(), entry


def _rank_part(
    tmp: Path, module: nn.Module, optimizers: list[Any], layout: Any, rank_state: dict
) -> RankPart:
    """Write this rank's files (what `layout.stores`) and return its part of the index."""
    coords = layout.coords
    writer = ShardWriter(coords)
    for key, tensor in module.state_dict().items():
        if layout.stores(key):
            _add_blocks(writer, _file("model", coords), f"model/{key}", tensor, layout, key, None)
    names = {id(p): n for n, p in module.named_parameters()}
    for k, opt in enumerate(optimizers):
        zero = hasattr(opt, "local_state_pieces")  # ZeRO-1: this dp rank's flat partition
        for p, start, end, entry in opt.local_state_pieces() if zero else _whole_pieces(opt):
            key = names[id(p)]
            if not layout.stores(key, zero_piece=zero):
                continue
            for skey, value in entry.items():
                name = f"optim/{k}/{key}/{skey}"
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == end - start:
                    flat = (start, end) if zero else None
                    _add_blocks(writer, _file("optim", coords), name, value, layout, key, flat, p.shape)
                elif start == 0 and coords["tp"] == 0:  # scalars (`step`): written once
                    writer.add_value(_file("optim", coords), name, value)
    part = writer.write(tmp)
    rank_file = tmp / f"rank-{rank_state['rank']:05d}.pt"
    own = {"rng": rank_state.get("rng"), "loop": rank_state.get("loop"), "coords": coords}
    part.record(rank_file, save_torch(rank_file, own))
    return part


def _add_blocks(
    writer: ShardWriter,
    file: str,
    name: str,
    tensor: torch.Tensor,
    layout: Any,
    key: str,
    flat: tuple[int, int] | None,
    local_shape: torch.Size | None = None,
) -> None:
    """Add this rank's part of global tensor `name` (of parameter `key`): `tensor`, the local
    tensor, or with `flat` that range of its flattening, as one piece per block of `layout.blocks`.
    Blocks of one local tensor split its tp dim, which is dim 0 where there are several (column
    layers), so each is a contiguous range of the flattening and a flat range cuts into one per block."""
    local_shape = tensor.shape if local_shape is None else local_shape
    full, dim = list(layout.full_shapes[key]), layout.tp_dims.get(key)
    blocks = layout.blocks(key, local_shape)
    if len(blocks) == 1:
        writer.add(file, name, tensor, full, *blocks[0], flat, dim)
        return
    n = math.prod(blocks[0][1])
    start, end = flat if flat is not None else (0, math.prod(local_shape))
    pieces = tensor.reshape(-1)
    for j, (offset, shape) in enumerate(blocks):
        lo, hi = max(start, j * n), min(end, (j + 1) * n)
        if lo < hi:
            part, part_flat = pieces[lo - start : hi - start], (lo - j * n, hi - j * n)
            whole = part_flat == (0, n) and flat is None
            piece = part.view(shape) if whole else part
            writer.add(
                file, name, piece, full, offset, shape, None if whole else part_flat, dim, f"{name}@{j}"
            )


# ---- every rank --------------------------------------------------------------------------------
def _on_every_rank(work: Callable[[], Any], what: str, tmp: Path, device: torch.device, ranks: bool) -> Any:
    """`work()`'s result, once all ranks have learned whether any rank's work failed: then every
    rank raises (rank 0 removes the temp dir) instead of some hanging in the next collective."""
    rank = dist.get_rank() if ranks else 0
    result, error = None, None
    try:
        result = work()
    except Exception as exc:
        error = exc
    failed = 0 if error is None else rank + 1
    if ranks:
        flag = torch.tensor([failed], device=device)
        # every rank contributes (its rank + 1) if it failed; MAX: one failure fails the save everywhere
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        failed = int(flag)
    if failed == 0:
        return result
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    if error is not None:
        raise error
    raise CheckpointError(f"checkpoint save failed: rank {failed - 1} failed {what} (see its error)")


def save_checkpoint(
    path: Path,
    module: nn.Module,
    optimizers: list[Any],
    layout: Any,
    trainer_state: dict[str, Any],
    topology: dict[str, Any],
    device: torch.device,
    extras: ExportExtras | None = None,
    ranks: bool = False,
) -> None:
    """Write checkpoint directory `path` atomically, replacing an earlier save of it. With `ranks`
    (torch.distributed is up) every rank calls it and writes its part: collective."""
    final = Path(path)
    rank, world = (dist.get_rank(), dist.get_world_size()) if ranks else (0, 1)
    tmp = temp_dir_for(final)
    if rank == 0:
        final.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(final.parent)  # left by a save that was killed
        tmp.mkdir()
    if ranks:
        dist.barrier()  # the temporary directory exists before any rank writes into it
    own = {**trainer_state, "rank": rank}
    part = _on_every_rank(
        lambda: _rank_part(tmp, module, optimizers, layout, own),
        "writing its checkpoint shards",
        tmp,
        device,
        ranks,
    )
    parts: list[Any] | None = [None] * world if rank == 0 else None
    if ranks:
        # every rank sends its file sizes and index entries to rank 0, which writes the index
        dist.gather_object(part, parts, dst=0)
    else:
        parts = [part]

    def finish() -> None:  # rank 0: the shared files, the index last, then the rename into place
        run = extras or ExportExtras()
        run.copy_into(tmp)
        shared = RankPart()
        groups = [[{k: v for k, v in g.items() if k != "params"} for g in o.param_groups] for o in optimizers]
        shared.record(tmp / GROUPS_FILE, save_torch(tmp / GROUPS_FILE, groups))
        shared.record(tmp / TRAINER_FILE, save_torch(tmp / TRAINER_FILE, trainer_state))
        described = next(
            ((n, m) for n, m in module.named_modules() if isinstance(m, HasDirectoryConfig)), None
        )
        if described is not None:  # the step directory is also a model directory
            prefix, model = described
            sharding = {"index": INDEX_FILE, "prefix": f"{prefix}." if prefix else ""}
            write_config(tmp, model.directory_config(), sharding, run.config)
        aliases = {f"model/{a}": f"model/{c}" for a, c in layout.aliases.items()}
        write_index(tmp, merge_parts([*parts, shared], topology, aliases))  # last: no index, no checkpoint
        publish(tmp, final)

    _on_every_rank(finish if rank == 0 else lambda: None, "writing the checkpoint index", tmp, device, ranks)
