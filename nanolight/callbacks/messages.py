"""Where the callbacks' ``verbose`` messages go: the ``nanolight`` logger, shown on stderr.

Lightning prints its callbacks' info messages through a logger with its own stream handler, so
``verbose=True`` is visible without configuring logging; this gives nanolight's the same (a
handler is added only when the application has not configured the ``nanolight`` logger itself).
"""

from __future__ import annotations

import logging

log = logging.getLogger("nanolight")
if not log.handlers:
    log.addHandler(logging.StreamHandler())
    log.setLevel(logging.INFO)
    log.propagate = False


def info(message: str, rank: int | None = None, rank_zero_only: bool = True) -> None:
    """Log `message` (prefixed with ``[rank: r]`` when `rank` is given). With `rank_zero_only`,
    ranks other than 0 stay silent."""
    if rank_zero_only and rank not in (None, 0):
        return
    log.info(f"[rank: {rank}] {message}" if rank is not None else message)
