"""`ModelSummary`: the parameter table printed when fit starts (``enable_model_summary``).

Counts are this rank's: under tensor or pipeline parallelism each rank holds a slice of the
model, so the table says so and gives the whole model's size from the strategy's layout.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from nanolight.callbacks.base import Callback


def _count(module: nn.Module) -> tuple[int, int]:
    total = sum(p.numel() for p in module.parameters())
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return total, trainable


def _human(n: float) -> str:
    for unit in ("", " K", " M", " B", " T"):
        if abs(n) < 1000:
            return f"{n:.0f}{unit}" if unit == "" else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n:.1f} P"


def summary_table(module: nn.Module, max_depth: int = 1) -> str:
    """Lightning's layout: one row per submodule down to `max_depth`, then the totals."""
    rows = [("", "Name", "Type", "Params", "Mode")]
    named = [(n, m) for n, m in module.named_modules() if n and n.count(".") < max_depth]
    for i, (name, sub) in enumerate(named):
        rows.append(
            (str(i), name, type(sub).__name__, _human(_count(sub)[0]), "train" if sub.training else "eval")
        )
    widths = [max(len(r[c]) for r in rows) for c in range(5)]
    line = "-" * (sum(widths) + 3 * 4 + 2)
    fmt = "  | ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*rows[0]), line, *(fmt.format(*r) for r in rows[1:]), line]
    total, trainable = _count(module)
    size_mb = sum(p.numel() * p.element_size() for p in module.parameters()) / 1e6
    out += [
        f"{_human(trainable):<10}Trainable params",
        f"{_human(total - trainable):<10}Non-trainable params",
        f"{_human(total):<10}Total params",
        f"{size_mb:<10.3f}Total estimated model params size (MB)",
    ]
    return "\n".join(out)


class ModelSummary(Callback):
    """Print the module's table at ``on_fit_start`` on global rank zero; `max_depth` levels of
    submodules (-1: all, 0: totals only)."""

    def __init__(self, max_depth: int = 1) -> None:
        self.max_depth = max_depth

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.is_global_zero or self.max_depth == 0:
            return
        depth = 10**6 if self.max_depth < 0 else self.max_depth
        table = summary_table(pl_module, depth)
        if trainer.world_size > 1:
            table += f"\n(counts of global rank 0's part of the model, one of {trainer.world_size} ranks)"
        print(table, flush=True)
