"""Full (unsharded) tensors of a `Parallel3DStrategy` run, in the single-device format.

Why both this and sharded checkpoints: the sharded format (``sharded_checkpoint.py``) is what
training saves -- every rank writes only what it owns. This gathered view is for everything
that wants whole tensors on one rank: loading a checkpoint written by `SingleDeviceStrategy`
(``model.safetensors`` + ``optimizer.pt``) into any layout, and comparing a parallel run with a
single-process one in tests. `model_state_dict` / `optimizer_state_dict` are collective (tp
ranks gather shards, pipeline rank 0 collects the stages, ZeRO-1 all-gathers its partitions).
"""

from __future__ import annotations

from typing import Any

import torch

from nanolight.parallel.tensor_parallel.apply import gather_full, shard_dims, take_shard
from nanolight.strategies.base import check_state_dict_matches


class GatheredStateMixin:
    """Mixed into `Parallel3DStrategy` (uses its module, context, pipeline, dp and tp group)."""

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors on tp rank 0 (every rank must call: it gathers); {} on the others."""
        assert self.module is not None
        dims, group = shard_dims(self.module, remove_duplicate=False), self._tp_group()
        full_by_id: dict[int, torch.Tensor] = {}
        out = {}
        for name, tensor in self.module.state_dict(keep_vars=True).items():
            if id(tensor) not in full_by_id:  # a tied weight is gathered once and stays shared
                full_by_id[id(tensor)] = gather_full(tensor.detach(), dims.get(name), group).cpu()
            out[name] = full_by_id[id(tensor)]
        if self._ctx.tp_rank != 0:
            return {}
        return self._pipeline.gather_model_state(out) if self._pipeline is not None else out

    def load_model_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Slice a full (any-layout) state dict to this rank's shards."""
        assert self.module is not None
        dims, group = shard_dims(self.module, remove_duplicate=False), self._tp_group()
        if self._pipeline is not None:  # checked against the whole model, then this stage's part
            state = self._pipeline.local_state_for_load(state, self.module.state_dict().keys())
        full_shapes = {
            name: _full_shape(t, dims.get(name), self.config.tp)
            for name, t in self.module.state_dict().items()
        }
        check_state_dict_matches(full_shapes, state)
        sliced = {name: take_shard(t, dims.get(name), group) for name, t in state.items()}
        self.module.load_state_dict(sliced, strict=True)
        if self._dp is not None:
            self._dp.reload_master_weights()  # ZeRO-1's fp32 master shards follow the new weights

    def _optimizer_dims(self, optimizer: torch.optim.Optimizer) -> list[int | None]:
        dims = shard_dims(self.module)
        by_id = {id(p): dims[name] for name, p in self.module.named_parameters()}
        return [by_id.get(id(p)) for group in optimizer.param_groups for p in group["params"]]

    def optimizer_state_dict(self) -> list[dict[str, Any]]:
        """Per-parameter optimizer tensors (Adam moments) gathered to full shape like the weights."""
        out = []
        for opt in self.optimizers:
            sd, dims = opt.state_dict(), self._optimizer_dims(opt)
            state = {}
            for idx, entry in sd["state"].items():  # copy: these dicts are the live optimizer state
                state[idx] = {k: self._gather_entry(v, dims[idx]) for k, v in entry.items()}
            sd = {**sd, "state": state}
            if self._pipeline is not None:  # re-indexed to the single-device parameter order
                sd = self._pipeline.optimizer_state_to_full(self.module, opt, sd)
            out.append(sd)
        return out

    def _gather_entry(self, value: Any, dim: int | None) -> Any:
        if not _is_param_shaped(value, dim):
            return value
        return gather_full(value, dim, self._tp_group()).cpu()

    def load_optimizer_state_dict(self, states: list[dict[str, Any]]) -> None:
        """Slice full optimizer tensors (saved at any layout) to this rank's shards."""
        sliced = []
        for opt, sd in zip(self.optimizers, states, strict=False):  # the base checks the count
            dims = self._optimizer_dims(opt)
            if self._pipeline is not None:  # single-device indices -> this stage's
                sd = self._pipeline.optimizer_state_to_local(self.module, opt, sd)
            state = {}
            for idx, entry in sd["state"].items():
                dim = dims[int(idx)]
                state[idx] = {
                    k: take_shard(v, dim, self._tp_group()) if _is_param_shaped(v, dim) else v
                    for k, v in entry.items()
                }
            sliced.append({**sd, "state": state})
        super().load_optimizer_state_dict(sliced)


def _is_param_shaped(value: Any, dim: int | None) -> bool:
    """An optimizer-state tensor shaped like its (sharded) parameter, e.g. Adam's exp_avg; not `step`."""
    return isinstance(value, torch.Tensor) and dim is not None and value.dim() > dim


def _full_shape(local: torch.Tensor, dim: int | None, tp: int) -> torch.Tensor:
    """A meta tensor with the unsharded shape, for checking a checkpoint against the model."""
    shape = list(local.shape)
    if dim is not None:
        shape[dim] *= tp
    return torch.empty(shape, device="meta")
