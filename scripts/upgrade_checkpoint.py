"""Convert a checkpoint of an earlier format into the one format of this nanolight.

    python scripts/upgrade_checkpoint.py OLD NEW [--overwrite]

Two steps, each taken when OLD needs it:

**Format before the index.** nanolight 0.1 saved one process as ``model.safetensors``,
``optimizer.pt`` (torch's optimizer state dicts, parameters named by position),
``trainer_state.pt`` and, later, ``checksums.json``. The trainer reads one format only
(``index.json`` + shards, `nanolight/checkpoint/`), so such a directory is converted once: NEW is
what a one-process save writes today, and a run resumed from it continues exactly as from OLD, at
any layout. The positions of ``optimizer.pt`` become parameter names through the model that OLD's
``config.json`` describes: each param group is taken to list the model's parameters in the model's
order, every parameter in one group (what the recipe's `param_groups`, and any filter of
``self.parameters()``, build). The stored state's shapes check that reading; one they cannot
confirm is an error, never a guess.

**Interleaved gate_up (format v1).** Up to format v1 the MLP's ``gate_up_proj`` rows were
interleaved per unit, [gate_0, up_0, gate_1, ...]; from v2 they are [gate | up]. Every tensor of
that shape -- the weight and each optimizer state of it -- is reordered in its global view. An
indexed checkpoint keeps its other files as they are (the files holding gate_up pieces are
rewritten without them) and its reordered gate_up tensors go to one file, each one whole shard:
the loader reads any block of any shard layout, so it resumes at any layout. A model directory
(``model.safetensors`` and ``config.json``, no trainer state) is rewritten whole.

Errors exit with status 1 and one line on stderr; NEW is written atomically, so a failed run
leaves nothing there.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

try:
    import nanolight  # noqa: F401
except ImportError:  # run from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanolight.checkpoint.atomic import (
    CheckpointError,
    atomic_directory,
    check_target,
    load_json,
    load_torch,
    open_tensors,
    save_tensors,
    verify,
)
from nanolight.checkpoint.index import FORMAT, FORMAT_V1, INDEX_FILE, CheckpointIndex, Shard, TensorEntry
from nanolight.checkpoint.reader import CheckpointReader
from nanolight.checkpoint.save import FORMAT_VERSION, ExportExtras, save_checkpoint
from nanolight.models import LlamaConfig, LlamaForCausalLM
from nanolight.parallel.layout import ModelLayout

WEIGHTS, OPTIMIZER, TRAINER, CHECKSUMS, CONFIG = (
    "model.safetensors",
    "optimizer.pt",
    "trainer_state.pt",
    "checksums.json",
    "config.json",
)
TAGS = ("format", "format_version", "sharding")  # config.json keys the writer sets itself
ONE_PROCESS = {"tp": 1, "pp": 1, "dp": 1, "world_size": 1}
GATE_UP = "mlp.gate_up_proj.weight"  # model/<key>, optim/<k>/<key>/<state>: every tensor of it
GATE_UP_FILE = "gate_up-blocked.safetensors"  # an upgraded indexed checkpoint's reordered gate_up


def blocked(interleaved: torch.Tensor) -> torch.Tensor:
    """gate_up rows [gate_0, up_0, gate_1, ...] -> [gate_0, gate_1, ... | up_0, up_1, ...]."""
    return interleaved.reshape(-1, 2, *interleaved.shape[1:]).transpose(0, 1).reshape(interleaved.shape)


def check_files(old: Path) -> dict[str, Any]:
    """OLD is an old one-process checkpoint, every file as written (`checksums.json`, when there);
    returns its config.json."""
    if (old / "index.json").is_file():
        raise CheckpointError(f"{old} has an index.json: it is in the one format already, nothing to upgrade")
    for name in (WEIGHTS, TRAINER):
        if not (old / name).is_file():
            raise CheckpointError(f"{old} is not a one-process nanolight 0.1 checkpoint: {name} is missing")
    if not (old / CONFIG).is_file():
        raise CheckpointError(
            f"{old} has no {CONFIG}: its module holds no nanolight Llama, so the order of the parameters "
            f"{OPTIMIZER} names by position cannot be rebuilt here"
        )
    manifest = old / CHECKSUMS
    for name, rec in (load_json(manifest, "checksums file") if manifest.is_file() else {}).items():
        verify(old / name, rec["size"], rec["crc32"])
    return load_json(old / CONFIG, "model config")


def build_module(old: Path, cfg: dict[str, Any]) -> nn.Module:
    """The saved module as far as a checkpoint knows it: the Llama under its attribute path (the
    ``sharding.prefix`` of config.json), holding OLD's weights."""
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig.from_dict(cfg))
    root: nn.Module = model
    prefix = (cfg.get("sharding") or {}).get("prefix") or ""
    for attr in reversed(prefix.rstrip(".").split(".") if prefix else []):
        holder = nn.Module()
        setattr(holder, attr, root)
        root = holder
    weights = open_tensors(old / WEIGHTS)
    state = {k: weights.get_tensor(k) for k in weights.keys()}  # noqa: SIM118
    state = {k: blocked(v) if k.endswith(GATE_UP) else v for k, v in state.items()}  # 0.1 interleaved
    root.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    return root


def _shape(entry: dict[str, Any]) -> tuple[int, ...] | None:
    """The parameter's shape as its state shows it (Adam's ``exp_avg``), or None (no such tensor)."""
    return next((tuple(v.shape) for v in entry.values() if isinstance(v, torch.Tensor) and v.dim() > 0), None)


def positional_params(module: nn.Module, states: list[dict[str, Any]]) -> list[list[list[nn.Parameter]]]:
    """For each optimizer and param group, its parameters in the order ``optimizer.pt`` numbers them."""
    groups = [(k, g) for k, sd in enumerate(states) for g in range(len(sd["param_groups"]))]
    ids = {kg: states[kg[0]]["param_groups"][kg[1]]["params"] for kg in groups}
    shapes = {kg: [_shape(states[kg[0]]["state"].get(i, {})) for i in ids[kg]] for kg in groups}
    named = list(module.named_parameters())
    if sum(len(v) for v in ids.values()) != len(named):
        raise CheckpointError(
            f"{OPTIMIZER} holds {sum(len(v) for v in ids.values())} parameters, the model {len(named)}: "
            "not every parameter is optimized, so their positions cannot be told apart"
        )
    out: dict[tuple[int, int], list[nn.Parameter]] = {kg: [] for kg in groups}
    for name, p in named:
        fits = [
            kg
            for kg in groups
            if len(out[kg]) < len(ids[kg]) and shapes[kg][len(out[kg])] in (None, tuple(p.shape))
        ]
        if len(fits) != 1:
            why = (
                "no param group's next parameter has"
                if not fits
                else "several param groups' next parameters have"
            )
            raise CheckpointError(f"{why} the shape of {name} {tuple(p.shape)}: the order cannot be rebuilt")
        out[fits[0]].append(p)
    return [[out[(k, g)] for g in range(len(sd["param_groups"]))] for k, sd in enumerate(states)]


def upgrade(old: str | Path, new: str | Path, overwrite: bool = False) -> Path:
    """Write NEW, the one-format checkpoint of old one-process checkpoint OLD."""
    old, new = Path(old), Path(new)
    cfg = check_files(old)
    check_target(new, overwrite)
    module = build_module(old, cfg)
    states = load_torch(old / OPTIMIZER, "optimizer state") if (old / OPTIMIZER).is_file() else []
    optimizers = []
    for sd, groups in zip(states, positional_params(module, states), strict=True):
        hyper = [
            {**{h: v for h, v in g.items() if h != "params"}, "params": ps}
            for g, ps in zip(sd["param_groups"], groups, strict=True)
        ]
        opt = torch.optim.Optimizer(hyper, {})  # only the state travels: the type is the module's
        opt.load_state_dict(sd)
        for name, p in module.named_parameters():  # its state is interleaved like the 0.1 weight
            for key, value in opt.state.get(p, {}).items() if name.endswith(GATE_UP) else ():
                if isinstance(value, torch.Tensor) and value.shape == p.shape:
                    opt.state[p][key] = blocked(value)
        optimizers.append(opt)
    described = set(LlamaConfig.from_dict(cfg).directory_fields()) | set(TAGS)
    others = {WEIGHTS, OPTIMIZER, TRAINER, CHECKSUMS, CONFIG}
    extras = ExportExtras(
        old,
        tuple(sorted(f.name for f in old.iterdir() if f.is_file() and f.name not in others)),
        {k: v for k, v in cfg.items() if k not in described},
    )
    trainer_state = load_torch(old / TRAINER, "trainer state")
    layout = ModelLayout.whole(module)
    save_checkpoint(new, module, optimizers, layout, trainer_state, ONE_PROCESS, torch.device("cpu"), extras)
    return new


def upgrade_v1(old: Path, new: Path, overwrite: bool = False) -> Path:
    """Write NEW, OLD (an indexed checkpoint or a model directory of format v1) with its gate_up
    tensors [gate | up]."""
    config = load_json(old / CONFIG, "model config") if (old / CONFIG).is_file() else {}
    if config:
        config["format_version"] = FORMAT_VERSION
    if not (old / INDEX_FILE).is_file():  # a model directory: one model.safetensors
        weights = open_tensors(old / WEIGHTS)
        state = {k: weights.get_tensor(k) for k in weights.keys()}  # noqa: SIM118
        with atomic_directory(new, overwrite) as tmp:
            save_tensors(
                tmp / WEIGHTS, {k: blocked(v) if k.endswith(GATE_UP) else v for k, v in state.items()}
            )
            _copy_others(old, tmp, {WEIGHTS, CONFIG}, config)
        return new
    raw = json.loads((old / INDEX_FILE).read_text())
    index = CheckpointIndex.from_json(json.dumps({**raw, "format": FORMAT}), old / INDEX_FILE)
    reader = CheckpointReader(old, index, True)
    reader.verify_all()  # every file as written (size, CRC-32) before any is converted or copied
    moved = {n: e for n, e in index.tensors.items() if GATE_UP in n and len(e.shape) == 2}
    with atomic_directory(new, overwrite) as tmp:
        upgraded = {name: blocked(reader.read(name)) for name in moved}
        index.checksums[GATE_UP_FILE] = save_tensors(tmp / GATE_UP_FILE, upgraded)
        index.files[GATE_UP_FILE] = (tmp / GATE_UP_FILE).stat().st_size
        dropped: dict[str, set[str]] = {}  # file -> its keys of gate_up pieces
        for name, entry in moved.items():
            for shard in entry.shards:
                dropped.setdefault(shard.file, set()).add(shard.key)
            index.tensors[name] = TensorEntry(
                entry.shape, entry.dtype, [Shard(GATE_UP_FILE, name, [0, 0], entry.shape)]
            )
        for file, keys in dropped.items():
            handle = open_tensors(old / file)
            kept = {k: handle.get_tensor(k) for k in handle.keys() if k not in keys}  # noqa: SIM118
            index.checksums[file] = save_tensors(tmp / file, kept)
            index.files[file] = (tmp / file).stat().st_size
        _copy_others(old, tmp, {INDEX_FILE, CONFIG, *dropped}, config)
        (tmp / INDEX_FILE).write_text(index.to_json())  # last: no index, no checkpoint
    return new


def _copy_others(old: Path, tmp: Path, handled: set[str], config: dict[str, Any]) -> None:
    """Copy OLD's files other than `handled` into `tmp`, and write `config` (if any) as config.json."""
    for file in old.iterdir():
        if file.is_file() and file.name not in handled:
            shutil.copyfile(file, tmp / file.name)
    if config:
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def is_v1(old: Path) -> bool:
    """OLD is in the one format of version 1 (gate_up interleaved): its index or config.json says so."""
    if (old / INDEX_FILE).is_file():
        return load_json(old / INDEX_FILE, "checkpoint index").get("format") == FORMAT_V1
    config = load_json(old / CONFIG, "model config") if (old / CONFIG).is_file() else {}
    return (
        config.get("format") == "nanolight"
        and config.get("format_version") == 1
        and not (old / TRAINER).is_file()
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "old", help="a checkpoint of an earlier format: one process of nanolight 0.1, or format v1"
    )
    parser.add_argument("new", help="where to write it in the one format (absent or empty)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty NEW")
    args = parser.parse_args(argv)
    try:
        old = Path(args.old)
        if is_v1(old):
            out = upgrade_v1(old, Path(args.new), args.overwrite)
        else:
            out = upgrade(old, args.new, args.overwrite)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
