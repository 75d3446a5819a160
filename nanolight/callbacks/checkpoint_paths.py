"""ModelCheckpoint's directories on disk: what one is called, where they go, how they are removed.

`format_name` fills a ``filename`` template from the monitored metrics and `default_dirpath` is
the directory used when ``dirpath`` is not given (Lightning's rules for both);
`remove_checkpoints` deletes the ones top-k and ``keep_last_n`` no longer keep;
`check_shared_directory`, at setup, that every rank sees the directory rank 0 writes into.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch import Tensor

from nanolight.checkpoint.atomic import LAST_POINTER, remove_directory, resolve_checkpoint, try_write_text
from nanolight.errors import UsageError

# "{name}" or "{name:spec}"; the name is anything up to ':' or '}' (dots and slashes included)
_FIELD = re.compile(r"\{([^{}:]+)(:[^{}]*)?\}")
_warned_slash: set[str] = set()


def format_name(
    template: str | None,
    metrics: Mapping[str, Any],
    auto_insert_metric_name: bool = True,
    prefix: str | None = None,
    version: int | None = None,
    join: str = "-",
    equals: str = "=",
) -> str:
    """The checkpoint's directory name (no path, no suffix) for `metrics`: ``"{epoch}-{val_loss:.3f}"``
    gives ``epoch=6-val_loss=0.682``; a name absent from the metrics formats as 0 (as Lightning).
    `join` and `equals` are ModelCheckpoint's ``CHECKPOINT_JOIN_CHAR`` and ``CHECKPOINT_EQUALS_CHAR``:
    `join` makes the default template ``{epoch}<join>{step}`` and adds the prefix and ``v<version>``,
    `equals` stands between an inserted metric name and its value."""

    def field(match: re.Match[str]) -> str:
        key, spec = match.group(1), (match.group(2) or ":")[1:]
        value = metrics.get(key, torch.tensor(0))
        if isinstance(value, Tensor) and value.numel() == 1:
            value = value.item()  # Tensor.__format__ does the same for 0-dim tensors
        text = format(value, spec)
        return f"{key}{equals}{text}" if auto_insert_metric_name else text

    name = _FIELD.sub(field, template or "{epoch}" + join + "{step}")
    if prefix is not None:
        name = f"{prefix}{join}{name}"
    if version is not None:
        name = f"{name}{join}v{version}"
    flat = name
    for sep in {"/", os.sep, os.altsep} - {None}:
        flat = flat.replace(sep, "_")
    if flat != name and name not in _warned_slash:
        _warned_slash.add(name)
        rank_zero_warn(
            f"ModelCheckpoint: the checkpoint name {name!r} contains a path separator (a metric name "
            f"such as 'val/loss' in `filename`); saving it as {flat!r} directly in `dirpath` instead "
            "of in a subdirectory. Pass a `filename` without '/' to choose the name yourself."
        )
    return flat


def default_dirpath(trainer: Any) -> str:
    """Lightning's rule: ``<save_dir>/<name>/<version>/checkpoints`` of the first logger, else
    ``<default_root_dir>/checkpoints``."""
    if not trainer.loggers:
        return os.path.join(str(trainer.default_root_dir), "checkpoints")
    logger = trainer.loggers[0]
    save_dir = logger.save_dir if logger.save_dir is not None else trainer.default_root_dir
    version = logger.version if isinstance(logger.version, str) else f"version_{logger.version}"
    return os.path.join(str(save_dir), str(logger.name), version, "checkpoints")


def remove_checkpoints(doomed: list[str], dirpath: str) -> list[str]:
    """Delete the `doomed` directories that sit directly in `dirpath` (as Lightning, which leaves
    files outside its directory alone), never the one ``<dirpath>/last`` names: that one is kept
    and left out of the list returned, the checkpoints to forget."""
    pointer = resolve_checkpoint(Path(dirpath) / LAST_POINTER)
    last = os.path.realpath(pointer) if pointer is not None else None
    doomed = [p for p in doomed if os.path.realpath(p) != last]
    for path in doomed:
        if Path(path).absolute().parent == Path(dirpath).absolute():
            remove_directory(path)
    return doomed


def check_shared_directory(strategy: Any, path: str | Path) -> None:
    """Every rank must see the directory rank 0 writes into, checked at start-up, not at the first
    save: rank 0 writes a token there, every rank reads it back, the ranks agree (collective, through
    `strategy`'s exchanges)."""
    if strategy.world_size == 1:
        return
    path, token = Path(path), strategy.broadcast(uuid.uuid4().hex if strategy.is_global_zero else None)
    probe = path / f".nanolight-shared-{token[:12]}"
    failed = strategy.broadcast(try_write_text(probe, token) if strategy.is_global_zero else None)
    if failed is not None:  # rank 0 could not write there (read-only, full): every rank says so
        raise UsageError(
            f"cannot write into {path} ({failed}): make it writable or choose another default_root_dir"
        )
    seen = probe.read_text() if probe.is_file() else None
    if strategy.agree_max(int(seen != token)).wait():  # any rank that does not see it
        if strategy.is_global_zero:
            probe.unlink(missing_ok=True)
        raise UsageError(
            f"rank {strategy.global_rank} {'sees' if seen == token else 'does not see'} the run directory "
            f"{path} that rank 0 writes (not every rank sees it): put trainer.default_root_dir on a "
            "filesystem that every node shares (or a path that exists on every node)"
        )
    strategy.barrier()
    if strategy.is_global_zero:
        probe.unlink(missing_ok=True)
