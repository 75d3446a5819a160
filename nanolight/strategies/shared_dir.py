"""Checked at start-up, not hours later at the first save: every rank sees the run directory
rank 0 writes into (checkpoints are written by all ranks). Rank 0 writes a token there, every
rank reads it back, and the ranks agree on the answer."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from nanolight.errors import UsageError


def check_shared_directory(strategy: Any, path: str | Path) -> None:
    """A clear error on every rank unless each sees `path` as rank 0 does (collective)."""
    if strategy.world_size == 1:
        return
    path, token = Path(path), strategy.broadcast(uuid.uuid4().hex if strategy.is_global_zero else None)
    probe = path / f".nanolight-shared-{token[:12]}"
    if strategy.is_global_zero:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_text(token)
    strategy.barrier()
    seen = probe.read_text() if probe.is_file() else None
    if strategy.any_rank(seen != token):
        if strategy.is_global_zero:
            probe.unlink(missing_ok=True)
        raise UsageError(
            f"rank {strategy.global_rank} {'sees' if seen == token else 'does not see'} the run directory {path} "
            "that rank 0 writes (not every rank sees it): put trainer.default_root_dir on a filesystem that "
            "every node shares (or a path that exists on every node)"
        )
    strategy.barrier()
    if strategy.is_global_zero:
        probe.unlink(missing_ok=True)
