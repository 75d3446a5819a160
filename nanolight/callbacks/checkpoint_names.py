"""Checkpoint directory names from Lightning-style filename templates.

``"{epoch}-{val_loss:.3f}"`` with ``auto_insert_metric_name`` becomes ``epoch=6-val_loss=0.682``;
no template means ``"{epoch}-{step}"``; a name absent from the metrics formats as 0 (as Lightning).
Why a module of its own: `ModelCheckpoint` and tests both need the exact formatting rules.

One deliberate difference: a metric name with ``/`` (``val/loss``) would make Lightning write into
a subdirectory (``val/loss=0.12.ckpt``). A nanolight checkpoint directory must sit directly in
``dirpath`` (the ``last`` pointer names it by its bare name), so ``/`` becomes ``_`` in the
formatted name, with a one-time warning that says so.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn

JOIN_CHAR = "-"
EQUALS_CHAR = "="
DEFAULT_TEMPLATE = "{epoch}" + JOIN_CHAR + "{step}"

# "{name}" or "{name:spec}"; the name is anything up to ':' or '}' (dots and slashes included)
_FIELD = re.compile(r"\{([^{}:]+)(:[^{}]*)?\}")
_warned_slash: set[str] = set()


def template_keys(template: str | None) -> list[str]:
    """The metric names a template refers to, in order."""
    return [m.group(1) for m in _FIELD.finditer(template or DEFAULT_TEMPLATE)]


def _format_value(value: Any, spec: str) -> str:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()  # Tensor.__format__ does the same for 0-dim tensors
    return format(value, spec)


def format_name(
    template: str | None,
    metrics: Mapping[str, Any],
    auto_insert_metric_name: bool = True,
    prefix: str | None = None,
    version: int | None = None,
) -> str:
    """The checkpoint's directory name (no path, no suffix) for `metrics`."""
    template = template or DEFAULT_TEMPLATE

    def field(match: re.Match[str]) -> str:
        key, spec = match.group(1), (match.group(2) or ":")[1:]
        value = metrics.get(key, torch.tensor(0))
        text = _format_value(value, spec)
        return f"{key}{EQUALS_CHAR}{text}" if auto_insert_metric_name else text

    name = _FIELD.sub(field, template)
    if prefix is not None:
        name = JOIN_CHAR.join([prefix, name])
    if version is not None:
        name = JOIN_CHAR.join([name, f"v{version}"])
    return _flatten(name)


def _flatten(name: str) -> str:
    """Path separators would create subdirectories; replace them (see the module docstring)."""
    seps = {"/", os.sep} | ({os.altsep} if os.altsep else set())
    if not any(s in name for s in seps):
        return name
    flat = name
    for s in seps:
        flat = flat.replace(s, "_")
    if name not in _warned_slash:
        _warned_slash.add(name)
        rank_zero_warn(
            f"ModelCheckpoint: the checkpoint name {name!r} contains a path separator (a metric name "
            f"such as 'val/loss' in `filename`); saving it as {flat!r} directly in `dirpath` instead "
            "of in a subdirectory. Pass a `filename` without '/' to choose the name yourself."
        )
    return flat
