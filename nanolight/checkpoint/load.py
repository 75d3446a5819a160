"""Loading a checkpoint into any layout: where a checkpoint is resharded.

Whatever wrote it (one process, or tp x pp x dp ranks with or without ZeRO-1) and whatever loads
it, each rank reads exactly the blocks its `ModelLayout` says it holds (`CheckpointReader.read`
assembles them from the stored shards), for the weights and for every parameter-shaped piece of
optimizer state. A ZeRO-1 optimizer keeps only its flat partition, so only the rows covering it
are read. One process is the trivial layout: every block is the whole tensor.

The data position and RNG states are restored per rank when the topology is unchanged; at another
topology every rank takes rank 0's, which is what a fresh run of that topology would have, since
all ranks are seeded alike and the data position counts global samples.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch
from torch import nn

from nanolight.checkpoint.reader import CheckpointReader
from nanolight.errors import UsageError


def check_matches(expected: dict[str, tuple[int, ...]], stored: dict[str, tuple[int, ...]]) -> None:
    """Raise a ValueError listing missing/unexpected keys and shape mismatches (first few of each)."""
    missing = [k for k in expected if k not in stored]
    unexpected = [k for k in stored if k not in expected]
    shapes = [
        f"{k}: checkpoint {tuple(stored[k])} vs model {tuple(v)}"
        for k, v in expected.items()
        if k in stored and tuple(stored[k]) != tuple(v)
    ]
    if not (missing or unexpected or shapes):
        return

    def head(items: list[str]) -> str:  # a few examples: another model size differs in every block
        return ", ".join(items[:3]) + (f", ... ({len(items)} in all)" if len(items) > 3 else "")

    parts = [f"missing in checkpoint: {head(missing)}"] if missing else []
    parts += [f"unexpected in checkpoint: {head(unexpected)}"] if unexpected else []
    parts += [f"shape mismatch: {head(shapes)}"] if shapes else []
    raise UsageError(
        "checkpoint does not match the model (was it saved from another model?) -- "
        + "; ".join(parts)
        + ". Load it into the model it was saved from (the same model preset/config as that run), or "
        "train this model from scratch in another directory (trainer.default_root_dir=..., or "
        "checkpoint.resume=null)"
    )


def load_model(
    reader: CheckpointReader,
    module: nn.Module,
    layout: Any,
    strip: str = "",
    stored_prefix: str = "",
    strict: bool = True,
) -> tuple[list[str], list[str]]:
    """Copy this rank's blocks of the stored weights into `module` (in place, no reallocation);
    returns the (missing, unexpected) keys, which only ``strict=False`` allows (shapes must match).

    A model directory names the causal LM's tensors, while a training module holds the LM under
    an attribute: `strip` is the module's key prefix of the part to load (keys outside it are not
    loaded), `stored_prefix` the checkpoint's own prefix (a training step directory's)."""
    keys = [k for k in module.state_dict() if k.startswith(strip) and k not in layout.aliases]
    # checked against the whole model (every stage's tensors), then this rank reads its blocks
    expected = {
        k.removeprefix(strip): s
        for k, s in layout.full_shapes.items()
        if k.startswith(strip) and k not in layout.aliases
    }
    aliases = {a.removeprefix(strip) for a in layout.aliases}
    stored = {
        n.removeprefix("model/" + stored_prefix): reader.shape(n)
        for n in reader.names("model/" + stored_prefix)
    }
    stored = {k: s for k, s in stored.items() if k not in aliases}
    missing = [k for k in expected if k not in stored]
    unexpected = [k for k in stored if k not in expected]
    if strict:
        check_matches(expected, stored)
    else:  # Lightning's load_state_dict(strict=False): absent keys allowed, shapes still checked
        check_matches(
            {k: v for k, v in expected.items() if k in stored},
            {k: stored[k] for k in stored if k in expected},
        )
        keys = [k for k in keys if k.removeprefix(strip) in stored]
    with torch.no_grad():
        for key in keys:
            tensor = own_tensor(module, key)
            blocks = layout.blocks(key, tensor.shape)
            name = f"model/{stored_prefix}{key.removeprefix(strip)}"
            parts = tensor.chunk(len(blocks), layout.tp_dims.get(key) or 0)  # views: copied into in place
            for part, (offset, shape) in zip(parts, blocks, strict=True):
                part.copy_(reader.read(name, offset, shape))
    return missing, unexpected


def own_tensor(module: nn.Module, key: str) -> torch.Tensor:
    """The parameter or buffer a state-dict key names, itself (to copy into). Not through
    ``state_dict(keep_vars=True)``: a module may override ``state_dict`` without that argument."""
    try:
        return module.get_parameter(key)
    except AttributeError:
        return module.get_buffer(key)


def load_optimizers(
    reader: CheckpointReader,
    optimizers: list[Any],
    module: nn.Module,
    layout: Any,
) -> None:
    """Build each optimizer's ``torch.optim`` state dict from the checkpoint and load it. A ZeRO
    optimizer takes the same format and keeps its own flat partition of it."""
    saved_groups = reader.optimizer_groups()
    if len(saved_groups) != len(optimizers):
        raise UsageError(
            f"checkpoint {reader.path} holds {len(saved_groups)} optimizer(s), "
            f"configure_optimizers returned {len(optimizers)}"
        )
    by_param: dict[tuple[int, str], list[str]] = defaultdict(list)
    for name in reader.names("optim/") + [n for n in reader.index.extras if n.startswith("optim/")]:
        _, k, key, skey = name.split("/", 3)
        by_param[(int(k), key)].append(skey)
    names = {id(p): n for n, p in module.named_parameters()}
    for k, (opt, hyper) in enumerate(zip(optimizers, saved_groups, strict=True)):
        if len(hyper) != len(opt.param_groups):
            raise UsageError(
                f"optimizer {k}: the checkpoint has {len(hyper)} param groups, the optimizer {len(opt.param_groups)}"
            )
        owned = opt.owned_ranges() if hasattr(opt, "owned_ranges") else None  # ZeRO-1: 1/dp of the rows
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
                    elif list(reader.shape(name)) == list(layout.full_shapes[key]):
                        entry[skey] = _read_param_state(reader, name, layout, key, owned, p)
                    else:
                        entry[skey] = reader.read(name).to(p.device)
                if entry:
                    state[idx] = entry
                ids.append(idx)
                idx += 1
            groups.append({**hyper[g], "params": ids})
        opt.load_state_dict({"state": state, "param_groups": groups})


def _read_param_state(
    reader: CheckpointReader, name: str, layout: Any, key: str, owned: dict | None, p: torch.Tensor
) -> torch.Tensor:
    """A param-shaped state tensor (this rank's tp blocks of it, `layout.blocks`). With `owned`
    (ZeRO-1), only the rows covering the owned flat range are read; the rest stays zero and is
    never used. Several blocks split dim 0 (column layers): each is a contiguous flat range."""
    blocks = layout.blocks(key, p.shape)
    if owned is None or p.dim() == 0:
        parts = [reader.read(name, offset, shape) for offset, shape in blocks]
        return torch.cat(parts, dim=layout.tp_dims.get(key) or 0).to(p.device)
    if id(p) not in owned:
        return torch.empty(0, device=p.device)  # another dp rank's partition: not read at all
    start, end = owned[id(p)]
    n = math.prod(blocks[0][1])
    out = None
    for j, (offset, shape) in enumerate(blocks):
        row = math.prod(shape[1:])
        a = min(max(start - j * n, 0), n)  # the owned range within block j (maybe empty)
        b = max(min(end - j * n, n), a)
        r0, r1 = a // row, -(-b // row)
        rows = reader.read(name, [offset[0] + r0, *offset[1:]], [r1 - r0, *shape[1:]])
        out = torch.zeros(p.shape, dtype=rows.dtype) if out is None else out
        out.view(-1)[j * n + r0 * row : j * n + r1 * row] = rows.reshape(-1)
    return out.to(p.device)


def trainer_state(
    reader: CheckpointReader, rank: int, topology: dict[str, Any], dp_rank: int = 0
) -> dict[str, Any]:
    """The trainer's state, with this rank's own RNG and data position when the layout is unchanged.
    At another tp x pp x cp with the same dp, a rank takes the saved state of the first rank with its
    dp coordinate (a data stream's position is per dp rank; cp ranks read the same samples); at
    another dp, rank 0's."""
    state = reader.trainer_state()
    if reader.indexed:
        keys, defaults = ("tp", "pp", "cp", "dp", "world_size"), {"cp": 1}  # cp: 1 before it existed
        saved = {k: reader.topology.get(k, defaults.get(k)) for k in keys}
        if saved == {k: topology.get(k, defaults.get(k)) for k in keys}:
            own = reader.rank_state(rank)
        elif saved["dp"] == topology.get("dp") and dp_rank:
            # (dp_rank, cp 0, pp 0, tp 0) of the saved mesh (`parallel/context.py` rank order)
            own = reader.rank_state(dp_rank * saved["cp"] * saved["pp"] * saved["tp"])
        else:
            return state
        state["rng"], state["loop"] = own["rng"], own["loop"]
    return state
