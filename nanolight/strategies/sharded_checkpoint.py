"""Sharded checkpoints of `Parallel3DStrategy`: who writes what, and the atomic directory protocol.

Ownership (each global tensor is stored exactly once; `merge_parts` checks it):
* weights: dp rank 0 of every (pp, tp) coordinate writes its tp slice; a tp-replicated tensor
  (norm weights) only tp rank 0; a tensor two stages hold (the tied embedding on the first and
  last stage) only the lowest stage; a tied alias (``lm_head.weight``) is not stored at all.
* optimizer state: the same rules; with ZeRO-1 every dp rank writes its flat partition of the
  (tp-local) state instead, and scalars such as Adam's ``step`` come from the rank holding the
  parameter's first element.
* rank-{r}.pt: every rank's RNG states and data position (restored per rank when the topology
  is unchanged; at another topology every rank takes rank 0's, which is what a fresh run of that
  topology would have, since all ranks are seeded alike and the data position is global).

Protocol: rank 0 makes ``.tmp-step-N`` next to the target; every rank writes and fsyncs its
files there; all ranks agree that every write succeeded (one all_reduce) -- a rank that failed
makes every rank raise, no one hangs; rank 0 gathers the entries, writes ``index.json`` last,
fsyncs, renames the directory into place. A crash at any moment leaves no ``step-N`` or a complete
one, and the trainer moves ``last`` only after this returns.

Loading reads, per rank, only the blocks it will hold (`ShardedReader.read`), from any topology.
"""

from __future__ import annotations

import json
import math
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nanolight.checkpoint.sharded import ShardedReader, ShardWriter, fsync_path, merge_parts, write_index
from nanolight.checkpoint.sharded.writer import RankPart
from nanolight.checkpoint.trainer_state import load_torch_file, publish_directory, save_torch_file
from nanolight.parallel.tensor_parallel.apply import shard_dims

TRAINER_FILE = "trainer_state.pt"
GROUPS_FILE = "optimizer_groups.pt"


def tied_aliases(module: nn.Module) -> dict[str, str]:
    """State-dict key -> the first key naming the same tensor (e.g. lm_head -> embed_tokens)."""
    first: dict[int, str] = {}
    aliases = {}
    for key, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in first:
            aliases[key] = first[id(tensor)]
        else:
            first[id(tensor)] = key
    return aliases


class ShardedCheckpointer:
    """Save/load for one rank of a `Parallel3DStrategy` (built in its `setup_module`).

    `full_shapes` / `aliases` describe the *unsharded, unsplit* model (recorded before tensor
    parallelism and the pipeline split); `model_config` is written as ``config.json`` so a step
    directory is also a nanolight pretrained checkpoint (``load_pretrained``, HF conversion).
    """

    def __init__(
        self,
        ctx: Any,
        module: nn.Module,
        full_shapes: dict[str, tuple[int, ...]],
        aliases: dict[str, str],
        topology: dict[str, Any],
        model_meta: dict[str, Any] | None = None,
    ) -> None:
        self.ctx, self.module = ctx, module
        self.full_shapes, self.aliases, self.topology = full_shapes, aliases, topology
        self.model_meta = model_meta
        self._lowest_stage: dict[str, int] | None = None

    # ---- geometry --------------------------------------------------------------------------
    def _dims(self) -> dict[str, int | None]:
        return shard_dims(self.module, remove_duplicate=False)

    def _block(self, key: str, local_shape: torch.Size, dim: int | None) -> tuple[list[int], list[int]]:
        """(offset, shape) of this rank's tp slice of global tensor `key`."""
        offset = [0] * len(local_shape)
        if dim is not None:
            offset[dim] = self.ctx.tp_rank * local_shape[dim]
        return offset, list(local_shape)

    def _stage_owner(self) -> dict[str, int]:
        """Key -> the lowest pipeline stage holding it (the tied embedding lives on two)."""
        if self._lowest_stage is None:
            mine = [k for k in self.module.state_dict() if k not in self.aliases]
            everyone: list[Any] = [None] * self.ctx.pp_size
            # the stages of one pipeline share which state-dict keys they hold (once, cached)
            dist.all_gather_object(everyone, mine, group=self.ctx.pp_group)
            owner: dict[str, int] = {}
            for stage, keys in enumerate(everyone):
                for k in keys:
                    owner.setdefault(k, stage)
            self._lowest_stage = owner
        return self._lowest_stage

    def _owns(self, key: str, dim: int | None, zero_piece: bool = False) -> bool:
        ctx = self.ctx
        if key in self.aliases or self._stage_owner().get(key) != ctx.pp_rank:
            return False
        if dim is None and ctx.tp_rank != 0:
            return False  # replicated over tp: tp rank 0 writes it
        return zero_piece or ctx.dp_rank == 0

    # ---- save ------------------------------------------------------------------------------
    def _file(self, kind: str) -> str:
        ctx = self.ctx
        name = f"{kind}-pp{ctx.pp_rank:02d}-tp{ctx.tp_rank:02d}"
        return f"{name}-dp{ctx.dp_rank:02d}.safetensors" if kind == "optim" else f"{name}.safetensors"

    def _write_rank(self, tmp: Path, optimizers: list[Any], state: dict[str, Any]) -> RankPart:
        ctx = self.ctx
        writer = ShardWriter({"pp": ctx.pp_rank, "tp": ctx.tp_rank, "dp": ctx.dp_rank})
        dims = self._dims()
        for key, tensor in self.module.state_dict().items():
            dim = dims.get(key)
            if self._owns(key, dim):
                offset, shape = self._block(key, tensor.shape, dim)
                writer.add(
                    self._file("model"),
                    f"model/{key}",
                    tensor,
                    list(self.full_shapes[key]),
                    offset,
                    shape,
                    tp_dim=dim,
                )
        names = {id(p): n for n, p in self.module.named_parameters()}
        for k, opt in enumerate(optimizers):
            self._add_optimizer_state(writer, k, opt, names, dims)
        part = writer.write(tmp)
        rank_file = tmp / f"rank-{ctx.global_rank:05d}.pt"
        coords = {"pp": ctx.pp_rank, "tp": ctx.tp_rank, "dp": ctx.dp_rank}
        save_torch_file(rank_file, {"rng": state.get("rng"), "loop": state.get("loop"), "coords": coords})
        fsync_path(rank_file)
        part.files[rank_file.name] = rank_file.stat().st_size
        return part

    def _add_optimizer_state(self, writer: ShardWriter, k: int, opt: Any, names: dict, dims: dict) -> None:
        zero = hasattr(opt, "local_state_pieces")  # ZeRO-1: this dp rank's flat partition
        for p, start, end, entry in opt.local_state_pieces() if zero else _whole_pieces(opt):
            key = names[id(p)]
            dim = dims.get(key)
            if not self._owns(key, dim, zero_piece=zero):
                continue
            offset, shape = self._block(key, p.shape, dim)
            flat = (start, end) if zero else None
            for skey, value in entry.items():
                name = f"optim/{k}/{key}/{skey}"
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == end - start:
                    full = list(self.full_shapes[key])
                    writer.add(self._file("optim"), name, value, full, offset, shape, flat, dim)
                elif start == 0 and self.ctx.tp_rank == 0:  # scalars (`step`): written once
                    _add_scalar(writer, self._file("optim"), name, value)

    def save(self, path: Path, optimizers: list[Any], state: dict[str, Any]) -> None:
        """Write checkpoint directory `path` (collective: every rank calls it)."""
        ctx, final = self.ctx, Path(path)
        tmp = final.parent / f".tmp-{final.name}"
        if ctx.global_rank == 0:
            final.parent.mkdir(parents=True, exist_ok=True)
            for stale in final.parent.glob(".tmp-*"):  # left by a save that was killed
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        dist.barrier()  # the temporary directory exists before any rank writes into it
        part, error = None, None
        try:
            part = self._write_rank(tmp, optimizers, state)
        except Exception as exc:  # reported to every rank below instead of hanging them
            error = exc
        _raise_if_any(
            error, "writing its checkpoint shards", tmp if ctx.global_rank == 0 else None, ctx.device
        )
        parts: list[Any] | None = [None] * ctx.world_size if ctx.global_rank == 0 else None
        # every rank sends its file sizes and index entries to rank 0, which writes the index
        dist.gather_object(part, parts, dst=0)
        error = None
        if ctx.global_rank == 0:
            try:
                self._finish(tmp, final, parts, optimizers, state)
            except Exception as exc:
                error = exc
        _raise_if_any(
            error, "writing the checkpoint index", tmp if ctx.global_rank == 0 else None, ctx.device
        )

    def _finish(
        self, tmp: Path, final: Path, parts: list[RankPart], optimizers: list[Any], state: dict
    ) -> None:
        groups = [
            [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] for opt in optimizers
        ]
        save_torch_file(tmp / GROUPS_FILE, groups)
        save_torch_file(tmp / TRAINER_FILE, state)
        if self.model_meta is not None:
            (tmp / "config.json").write_text(json.dumps(self.model_meta, indent=2) + "\n")
        for name in (GROUPS_FILE, TRAINER_FILE, "config.json"):
            if (tmp / name).exists():
                fsync_path(tmp / name)
        index = merge_parts(
            parts, self.topology, {f"model/{a}": f"model/{c}" for a, c in self.aliases.items()}
        )
        for name in (GROUPS_FILE, TRAINER_FILE):
            index.files[name] = (tmp / name).stat().st_size
        write_index(tmp, index)  # last: a directory without an index is not a checkpoint
        publish_directory(tmp, final)

    # ---- load ------------------------------------------------------------------------------
    def load_model(self, path: Path) -> dict[str, Any]:
        """Load this rank's slice of the weights; return the trainer state (this rank's RNG and
        data position when the topology is unchanged)."""
        from nanolight.strategies.base import check_state_dict_matches

        reader = ShardedReader(path)
        stored = {
            n.removeprefix("model/"): torch.empty(reader.shape(n), device="meta")
            for n in reader.names("model/")
        }
        expected = {k: torch.empty(s, device="meta") for k, s in self.full_shapes.items()}
        check_state_dict_matches(expected, stored)
        dims = self._dims()
        local = {}
        for key, tensor in self.module.state_dict().items():
            offset, shape = self._block(key, tensor.shape, dims.get(key))
            local[key] = reader.read(f"model/{key}", offset, shape)
        self.module.load_state_dict(local, strict=True)
        return self._trainer_state(reader)

    def _trainer_state(self, reader: ShardedReader) -> dict[str, Any]:
        state = load_torch_file(reader.path / TRAINER_FILE) if (reader.path / TRAINER_FILE).exists() else {}
        saved = {k: reader.topology.get(k) for k in ("tp", "pp", "dp", "world_size")}
        if saved == {k: self.topology[k] for k in saved}:
            own = load_torch_file(reader.path / f"rank-{self.ctx.global_rank:05d}.pt")
            state["rng"], state["loop"] = own["rng"], own["loop"]
        return state

    def load_optimizers(self, path: Path, optimizers: list[Any]) -> None:
        reader = ShardedReader(path)
        dims = self._dims()
        load_optimizer_states(
            reader, optimizers, self.module, lambda key, p: self._block(key, p.shape, dims.get(key))
        )


def load_optimizer_states(
    reader: ShardedReader, optimizers: list[Any], module: nn.Module, block: Any
) -> None:
    """Build each optimizer's ``torch.optim`` state dict from the checkpoint and load it.

    `block(key, param) -> (offset, shape)` says which part of the global tensor this rank's
    parameter is (its tp slice; the whole tensor on one device). A ZeRO optimizer takes the
    same format and keeps its own flat partition of it."""
    groups_file = reader.path / GROUPS_FILE
    saved_groups = load_torch_file(groups_file) if groups_file.exists() else None
    if saved_groups is None or len(saved_groups) != len(optimizers):
        raise ValueError(
            f"checkpoint {reader.path} holds {0 if saved_groups is None else len(saved_groups)} optimizer(s), "
            f"configure_optimizers returned {len(optimizers)}"
        )
    by_param: dict[tuple[int, str], list[str]] = defaultdict(list)
    for name in reader.names("optim/"):
        _, k, key, skey = name.split("/", 3)
        by_param[(int(k), key)].append(skey)
    for name in reader.index.extras:
        if name.startswith("optim/"):
            _, k, key, skey = name.split("/", 3)
            by_param[(int(k), key)].append(skey)
    names = {id(p): n for n, p in module.named_parameters()}
    for k, (opt, hyper) in enumerate(zip(optimizers, saved_groups, strict=True)):
        if len(hyper) != len(opt.param_groups):
            raise ValueError(
                f"optimizer {k}: the checkpoint has {len(hyper)} param groups, the optimizer {len(opt.param_groups)}"
            )
        # ZeRO-1 keeps only its partition: read just those rows (1/dp of the I/O and memory)
        owned = opt.owned_ranges() if hasattr(opt, "owned_ranges") else None
        state, groups, idx = {}, [], 0
        for g, group in enumerate(opt.param_groups):
            ids = []
            for p in group["params"]:
                key = names[id(p)]
                entry = {}
                for skey in by_param.get((k, key), []):
                    name = f"optim/{k}/{key}/{skey}"
                    if name in reader.index.extras:
                        entry[skey] = reader.index.extras[name]
                    elif list(reader.shape(name)) == list(reader.shape(f"model/{key}")):
                        entry[skey] = _read_param_state(reader, name, *block(key, p), owned, p)
                    else:
                        entry[skey] = reader.read(name).to(p.device)
                if entry:
                    state[idx] = entry
                ids.append(idx)
                idx += 1
            groups.append({**hyper[g], "params": ids})
        opt.load_state_dict({"state": state, "param_groups": groups})


def _read_param_state(
    reader: ShardedReader, name: str, offset: Any, shape: Any, owned: dict | None, p: torch.Tensor
) -> torch.Tensor:
    """A param-shaped state tensor (this rank's tp block of it). With `owned` (ZeRO-1), only the
    rows covering the owned flat range are read; the rest stays zero and is never used."""
    if owned is None or p.dim() == 0:
        return reader.read(name, offset, shape).to(p.device)
    if id(p) not in owned:
        return torch.empty(0, device=p.device)  # another dp rank's partition: not read at all
    start, end = owned[id(p)]
    shape = list(p.shape) if shape is None else list(shape)
    offset = [0] * len(shape) if offset is None else list(offset)
    row = math.prod(shape[1:])
    r0, r1 = start // row, -(-end // row)
    rows = reader.read(name, [offset[0] + r0, *offset[1:]], [r1 - r0, *shape[1:]])
    out = torch.zeros(shape, dtype=rows.dtype)
    out.view(-1)[r0 * row : r1 * row] = rows.reshape(-1)
    return out.to(p.device)


def _whole_pieces(opt: Any) -> Any:
    """A plain optimizer's state as `ZeroOptimizer.local_state_pieces` gives it: whole params."""
    params = [p for g in opt.param_groups for p in g["params"]]
    for idx, entry in opt.state_dict()["state"].items():
        p = params[int(idx)]
        yield p, 0, p.numel(), entry


def _add_scalar(writer: ShardWriter, file: str, name: str, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        writer.add(file, name, value, list(value.shape))
    elif value is None or isinstance(value, bool | int | float | str):
        writer.add_extra(name, value)
    else:
        raise TypeError(
            f"optimizer state {name} is a {type(value).__name__}: only tensors and plain values are saved"
        )


def _raise_if_any(error: Exception | None, what: str, cleanup: Path | None, device: torch.device) -> None:
    """All ranks learn whether any rank failed (then every rank raises; rank 0 removes the temp dir)."""
    flag = torch.tensor([0 if error is None else 1], device=device)
    # every rank contributes whether it failed; MAX: one failure fails the save everywhere
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if int(flag) == 0:
        return
    if cleanup is not None:
        shutil.rmtree(cleanup, ignore_errors=True)
    if error is not None:
        raise error
    raise RuntimeError(
        f"checkpoint save failed: another rank failed {what} (see its error); nothing was published"
    )
