"""``lightning.pytorch.profilers``' import path: nanolight has no profilers, and each of Lightning's
names fails with one line saying what to use instead (`torch.profiler`, `ThroughputMonitor`)."""

from __future__ import annotations

from nanolight.errors import missing_name

__all__: list[str] = []


def __getattr__(name: str) -> object:
    """Lightning's profilers fail with what to use instead (`errors.LIGHTNING_ONLY`)."""
    raise missing_name(__name__, name)
