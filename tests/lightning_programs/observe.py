"""Shared recorder for the Lightning-fidelity programs: turns a finished run into ``observed.json``.

It reads only what a user's script can read (trainer attributes, callback attributes, the files the
CSV logger wrote), and imports neither Lightning nor nanolight, so the same file serves a program
before and after the renames. Everything is reduced to JSON scalars and lists, so fixtures can be
compared field by field.
"""

from __future__ import annotations

import csv
import json
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml


def to_jsonable(value: Any) -> Any:
    """Tensors become floats/lists, containers are walked; ints stay ints so steps compare exactly."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        return value.item() if value.ndim == 0 else value.tolist()
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):
        return value
    return repr(value)


def metrics_dict(metrics: dict[str, Any]) -> dict[str, float]:
    """A metrics mapping as {key: float}, keys sorted (their order is not a semantic)."""
    return {k: float(v) for k, v in sorted(metrics.items())}


def read_csv_logs(outdir: Path) -> tuple[dict[str, list[dict[str, float]]], dict[str, list[str]]]:
    """Every metrics.csv under outdir: rows in file order with empty cells dropped, and the header."""
    rows: dict[str, list[dict[str, float]]] = {}
    headers: dict[str, list[str]] = {}
    for path in sorted(outdir.rglob("metrics.csv")):
        rel = path.relative_to(outdir).as_posix()
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            headers[rel] = list(reader.fieldnames or [])
            rows[rel] = [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in reader]
    return rows, headers


def read_hparams(outdir: Path) -> dict[str, Any]:
    """Every hparams.yaml under outdir, parsed (an empty file parses to None)."""
    return {
        p.relative_to(outdir).as_posix(): yaml.safe_load(p.read_text())
        for p in sorted(outdir.rglob("hparams.yaml"))
    }


def stem(path: str | os.PathLike[str] | None) -> str | None:
    """A checkpoint's basename without ``.ckpt``: Lightning writes files, nanolight directories."""
    if not path:
        return None
    name = Path(path).name
    return name[: -len(".ckpt")] if name.endswith(".ckpt") else name


def checkpoint_info(trainer: Any, outdir: Path) -> list[dict[str, Any]]:
    """What each ModelCheckpoint kept on disk and selected; optional extras read with getattr."""
    out = []
    for cb in trainer.checkpoint_callbacks:
        dirpath = Path(cb.dirpath) if cb.dirpath else None
        files = sorted(stem(p) for p in dirpath.iterdir()) if dirpath and dirpath.is_dir() else []
        score = cb.best_model_score
        best_k = getattr(cb, "best_k_models", None) or {}
        try:
            rel_dir = dirpath.resolve().relative_to(outdir.resolve()).as_posix() if dirpath else None
        except ValueError:
            rel_dir = None
        out.append(
            {
                "monitor": cb.monitor,
                "dirpath": rel_dir,
                "files": files,
                "best_model_path": stem(cb.best_model_path),
                "best_model_score": None if score is None else float(score),
                "last_model_path": stem(getattr(cb, "last_model_path", None)),
                "best_k_models": {stem(k): float(v) for k, v in sorted(best_k.items())},
            }
        )
    return out


def final_weights(module: torch.nn.Module) -> dict[str, Any]:
    """Parameters by name as nested lists (the models are tiny)."""
    return {name: p.detach().cpu().tolist() for name, p in module.named_parameters()}


def snapshot(trainer: Any) -> dict[str, Any]:
    """Counters and metric dicts as they stand now (taken after each trainer call)."""
    return {
        "global_step": int(trainer.global_step),
        "current_epoch": int(trainer.current_epoch),
        "callback_metrics": metrics_dict(trainer.callback_metrics),
        "logged_metrics": metrics_dict(trainer.logged_metrics),
    }


def run_summary(trainer: Any, module: torch.nn.Module, outdir: str | os.PathLike[str]) -> dict[str, Any]:
    """The state every program records after its last trainer call."""
    return {
        **snapshot(trainer),
        "checkpoints": checkpoint_info(trainer, Path(outdir)),
        "final_weights": final_weights(module),
    }


def write_observed(outdir: str | os.PathLike[str], observed: dict[str, Any]) -> Path:
    """Add the CSV logs and hparams found under outdir and write outdir/observed.json."""
    out = Path(outdir)
    csv_rows, csv_columns = read_csv_logs(out)
    record = {"csv": csv_rows, "csv_columns": csv_columns, "hparams_yaml": read_hparams(out)}
    record.update(to_jsonable(observed))
    path = out / "observed.json"
    path.write_text(json.dumps(record, indent=1, sort_keys=False) + "\n")
    return path


def relative(path: str | os.PathLike[str] | None, outdir: str | os.PathLike[str]) -> str | None:
    """A path the framework chose, relative to the section's directory (temp dirs differ per run);
    checkpoints by stem (Lightning writes ``x.ckpt`` files, nanolight ``x`` directories)."""
    if not path:
        return None
    rel = os.path.relpath(os.fspath(path), os.fspath(outdir)).replace(os.sep, "/")
    return rel[: -len(".ckpt")] if rel.endswith(".ckpt") else rel


def listing(directory: str | os.PathLike[str]) -> list[str]:
    """The entries of a directory, sorted, checkpoints by stem; [] when it does not exist."""
    d = Path(directory)
    return sorted(stem(p.name) or "" for p in d.iterdir()) if d.is_dir() else []


def raises(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
    """Whether calling fn raises (the frameworks' exception types and messages differ)."""
    try:
        fn(*args, **kwargs)
    except Exception:
        return True
    return False


def by_stem(directory: str | os.PathLike[str], name: str) -> str:
    """The checkpoint named `name` in a directory: Lightning's ``name.ckpt`` file, nanolight's directory."""
    found = [n for n in os.listdir(directory) if (stem(n) or "") == name]
    return os.path.join(directory, found[0])


def selection(cb: Any, outdir: str | os.PathLike[str]) -> dict[str, Any]:
    """What a ModelCheckpoint kept and selected, paths relative to `outdir` (the section's directory,
    unlike `checkpoint_info`'s basenames), scores to 5 decimals; nanolight's ``last`` pointer is left
    out of the listing unless ``save_last`` asked for a last checkpoint."""

    def score(v: Any) -> Any:
        return None if v is None else round(float(v), 5)

    files = listing(cb.dirpath) if cb.dirpath else []
    return {
        "files": files if cb.save_last else [n for n in files if n != "last"],
        "best_model_path": relative(cb.best_model_path, outdir),
        "best_model_score": score(cb.best_model_score),
        "best_k_models": {relative(k, outdir): score(v) for k, v in sorted(cb.best_k_models.items())},
        "kth_best_model_path": relative(cb.kth_best_model_path, outdir),
        "last_model_path": relative(cb.last_model_path, outdir),
        "current_score": score(cb.current_score),
    }


def run_sections(
    outdir: str, sections: list[Callable[[str], dict[str, Any]]], seed: Callable[[int], Any]
) -> None:
    """Each section in its own directory after `seed(3)`; one that raises records its error (type
    and first line) as its result, so a test names the one behaviour that differs."""
    observed: dict[str, Any] = {}
    for section in sections:
        seed(3)
        where = os.path.join(outdir, section.__name__)
        os.makedirs(where)
        try:
            observed[section.__name__] = section(where)
        except Exception as exc:  # one section's failure must not hide the others'
            traceback.print_exc()
            observed[section.__name__] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    write_observed(outdir, observed)
