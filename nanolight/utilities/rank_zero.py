"""Printing and warning on global rank 0 only. These are lightning-utilities' own functions (the
ones Lightning re-exports): ``rank_zero_only.rank`` is set by ``nanolight/__init__.py`` from the
launcher's environment and again by the strategy once it knows the rank, so a program's
``@rank_zero_only`` functions and nanolight's messages agree on who rank 0 is."""

from lightning_utilities.core.rank_zero import (
    rank_prefixed_message,
    rank_zero_debug,
    rank_zero_deprecation,
    rank_zero_info,
    rank_zero_only,
    rank_zero_warn,
)

__all__ = [
    "rank_prefixed_message",
    "rank_zero_debug",
    "rank_zero_deprecation",
    "rank_zero_info",
    "rank_zero_only",
    "rank_zero_warn",
]
