"""Writing a training checkpoint directory: one process's files, or every rank's shards + an index.

One process (``SingleDeviceStrategy``): ``model.safetensors`` (the module's state dict),
``optimizer.pt`` (each optimizer's ``torch.optim`` state dict), ``trainer_state.pt`` and, when
the module holds a nanolight model, ``config.json`` (so the step directory is a model directory).

Several ranks (``Parallel3DStrategy``), who writes what -- each global tensor exactly once,
which `merge_parts` checks -- is `ModelLayout.stores`: dp rank 0 of every (pp, tp) writes its tp
block of its stage's weights; a tp-replicated tensor only tp rank 0; a tensor two stages hold
(the tied embedding) only the lowest stage; an alias (a tied ``lm_head.weight``) nothing. The
optimizer state follows the same rules, except that with ZeRO-1 every dp rank writes its flat
partition, and scalars such as Adam's ``step`` come from the holder of the parameter's first
element. Every rank also writes ``rank-<R>.pt`` (its RNG states and data position).

The protocol: rank 0 makes ``.tmp-step-N``; every rank writes and fsyncs its files there; all
ranks agree that every write succeeded (one all_reduce: a rank that failed, e.g. on a full disk,
makes every rank raise, no one hangs, nothing is published); rank 0 gathers the index entries,
writes ``index.json`` last, and renames the directory into place (`atomic.publish`). The trainer
moves ``last`` only after this returns.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nanolight.checkpoint.atomic import atomic_directory, fsync_path, publish, remove_stale, temp_dir_for
from nanolight.checkpoint.files import CheckpointError, save_tensors, save_torch
from nanolight.checkpoint.reader import (
    CHECKSUMS_FILE,
    GROUPS_FILE,
    OPTIMIZER_FILE,
    TRAINER_FILE,
    WEIGHTS_FILE,
)
from nanolight.checkpoint.writer import RankPart, ShardWriter, merge_parts, write_index

CONFIG_FILE = "config.json"


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def _dedupe_shared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied embeddings): save copies instead."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for name, tensor in state.items():
        tensor = tensor.detach()
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        out[name] = tensor.clone().contiguous() if key in seen else tensor.contiguous()
        seen.add(key)
    return out


def save_one_process(
    path: Path,
    model_state: dict[str, torch.Tensor],
    optimizer_states: list[dict[str, Any]],
    trainer_state: dict[str, Any],
    model_meta: dict[str, Any] | None = None,
    files: dict[str, Path] | None = None,
) -> None:
    """Write a one-process checkpoint directory atomically (replacing an earlier save of it);
    `files` (name -> source) are copied in, e.g. the tokenizer."""
    path = Path(path)
    if path.parent.is_dir():
        remove_stale(path.parent)
    with atomic_directory(path, overwrite=True) as tmp:
        crcs = {
            WEIGHTS_FILE: save_tensors(tmp / WEIGHTS_FILE, _dedupe_shared(model_state)),
            OPTIMIZER_FILE: save_torch(tmp / OPTIMIZER_FILE, optimizer_states),
            TRAINER_FILE: save_torch(tmp / TRAINER_FILE, trainer_state),
        }
        if model_meta is not None:
            _write_json(tmp / CONFIG_FILE, model_meta)
        _copy(files, tmp)
        manifest = {name: {"size": (tmp / name).stat().st_size, "crc32": crc} for name, crc in crcs.items()}
        _write_json(tmp / CHECKSUMS_FILE, manifest)  # the one-process index of what was written


# ---- several ranks ---------------------------------------------------------------------------
def _copy(files: dict[str, Path] | None, directory: Path) -> None:
    for name, src in (files or {}).items():
        shutil.copyfile(src, directory / name)
        fsync_path(directory / name)


def _file(kind: str, coords: dict[str, int]) -> str:
    name = f"{kind}-pp{coords['pp']:02d}-tp{coords['tp']:02d}"
    return f"{name}-dp{coords['dp']:02d}.safetensors" if kind == "optim" else f"{name}.safetensors"


def _whole_pieces(opt: Any) -> Iterator[tuple[nn.Parameter, int, int, dict[str, Any]]]:
    """A plain optimizer's state as `ZeroOptimizer.local_state_pieces` gives it: whole params."""
    params = [p for g in opt.param_groups for p in g["params"]]
    for idx, entry in opt.state_dict()["state"].items():
        p = params[int(idx)]
        yield p, 0, p.numel(), entry


def _add_value(writer: ShardWriter, file: str, name: str, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        writer.add(file, name, value, list(value.shape))
    elif value is None or isinstance(value, bool | int | float | str):
        writer.add_extra(name, value)
    else:
        raise TypeError(
            f"optimizer state {name} is a {type(value).__name__}: only tensors and plain values are saved"
        )


def _rank_part(
    tmp: Path, module: nn.Module, optimizers: list[Any], layout: Any, rank_state: dict
) -> RankPart:
    """Write this rank's files (what `layout.stores`) and return its part of the index."""
    coords = layout.coords
    writer = ShardWriter(coords)
    for key, tensor in module.state_dict().items():
        if layout.stores(key):
            offset, shape = layout.block(key, tensor.shape)
            dim = layout.tp_dims.get(key)
            writer.add(
                _file("model", coords),
                f"model/{key}",
                tensor,
                list(layout.full_shapes[key]),
                offset,
                shape,
                tp_dim=dim,
            )
    names = {id(p): n for n, p in module.named_parameters()}
    for k, opt in enumerate(optimizers):
        zero = hasattr(opt, "local_state_pieces")  # ZeRO-1: this dp rank's flat partition
        for p, start, end, entry in opt.local_state_pieces() if zero else _whole_pieces(opt):
            key = names[id(p)]
            if not layout.stores(key, zero_piece=zero):
                continue
            offset, shape = layout.block(key, p.shape)
            for skey, value in entry.items():
                name = f"optim/{k}/{key}/{skey}"
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == end - start:
                    full, flat, dim = (
                        list(layout.full_shapes[key]),
                        (start, end) if zero else None,
                        layout.tp_dims.get(key),
                    )
                    writer.add(_file("optim", coords), name, value, full, offset, shape, flat, dim)
                elif start == 0 and coords["tp"] == 0:  # scalars (`step`): written once
                    _add_value(writer, _file("optim", coords), name, value)
    part = writer.write(tmp)
    rank_file = tmp / f"rank-{rank_state['rank']:05d}.pt"
    own = {"rng": rank_state.get("rng"), "loop": rank_state.get("loop"), "coords": coords}
    part.checksums[rank_file.name] = save_torch(rank_file, own)
    part.files[rank_file.name] = rank_file.stat().st_size
    return part


def _raise_if_any(error: Exception | None, what: str, cleanup: Path | None, device: torch.device) -> None:
    """All ranks learn whether any rank failed (then every rank raises; rank 0 removes the temp dir)."""
    flag = torch.tensor([0 if error is None else dist.get_rank() + 1], device=device)
    # every rank contributes (its rank + 1) if it failed; MAX: one failure fails the save everywhere
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if int(flag) == 0:
        return
    if cleanup is not None:
        shutil.rmtree(cleanup, ignore_errors=True)
    if error is not None:
        raise error
    raise CheckpointError(f"checkpoint save failed: rank {int(flag) - 1} failed {what} (see its error)")


def save_sharded(
    path: Path,
    module: nn.Module,
    optimizers: list[Any],
    layout: Any,
    trainer_state: dict[str, Any],
    topology: dict[str, Any],
    model_meta: dict[str, Any] | None,
    device: torch.device,
    files: dict[str, Path] | None = None,
) -> None:
    """Write checkpoint directory `path` from every rank (collective: all ranks call it); rank 0
    copies `files` (name -> source) in."""
    final, rank, world = Path(path), dist.get_rank(), dist.get_world_size()
    tmp = temp_dir_for(final)
    if rank == 0:
        final.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(final.parent)  # left by a save that was killed
        tmp.mkdir()
    dist.barrier()  # the temporary directory exists before any rank writes into it
    part, error = None, None
    try:
        part = _rank_part(tmp, module, optimizers, layout, {**trainer_state, "rank": rank})
    except Exception as exc:  # reported to every rank below instead of hanging them
        error = exc
    _raise_if_any(error, "writing its checkpoint shards", tmp if rank == 0 else None, device)
    parts: list[Any] | None = [None] * world if rank == 0 else None
    # every rank sends its file sizes and index entries to rank 0, which writes the index
    dist.gather_object(part, parts, dst=0)
    error = None
    if rank == 0:
        try:
            _copy(files, tmp)
            _finish(tmp, final, parts, optimizers, layout, trainer_state, topology, model_meta)
        except Exception as exc:
            error = exc
    _raise_if_any(error, "writing the checkpoint index", tmp if rank == 0 else None, device)


def _finish(
    tmp: Path,
    final: Path,
    parts: list[RankPart],
    optimizers: list[Any],
    layout: Any,
    trainer_state: dict,
    topology: dict,
    model_meta: dict | None,
) -> None:
    groups = [[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] for opt in optimizers]
    crcs = {
        GROUPS_FILE: save_torch(tmp / GROUPS_FILE, groups),
        TRAINER_FILE: save_torch(tmp / TRAINER_FILE, trainer_state),
    }
    if model_meta is not None:
        _write_json(tmp / CONFIG_FILE, model_meta)
        fsync_path(tmp / CONFIG_FILE)
    index = merge_parts(parts, topology, {f"model/{a}": f"model/{c}" for a, c in layout.aliases.items()})
    for name, crc in crcs.items():
        index.files[name], index.checksums[name] = (tmp / name).stat().st_size, crc
    write_index(tmp, index)  # last: a directory without an index is not a checkpoint
    publish(tmp, final)
