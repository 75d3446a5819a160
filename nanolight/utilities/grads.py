"""`grad_norm`: each parameter's gradient norm and the total, keyed as Lightning's are
(``grad_2.0_norm/layer.weight``, ``grad_2.0_norm_total``), so dashboards built on Lightning's keys
keep working. Log it from ``on_before_optimizer_step``: ``self.log_dict(grad_norm(self, 2))``."""

from __future__ import annotations

import torch


def grad_norm(
    module: torch.nn.Module, norm_type: float | int | str, group_separator: str = "/"
) -> dict[str, torch.Tensor]:
    """Norms of the gradients of `module`'s parameters that have one, and their norm as one
    vector (absent when no parameter has a gradient). `norm_type` may be ``"inf"``."""
    norm = float(norm_type)
    if norm <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm}")
    norms = {
        f"grad_{norm}_norm{group_separator}{name}": p.grad.detach().norm(norm)
        for name, p in module.named_parameters()
        if p.grad is not None
    }
    if norms:
        norms[f"grad_{norm}_norm_total"] = torch.stack(list(norms.values())).norm(norm)  # no host sync
    return norms
