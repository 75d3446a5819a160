"""ZeRO-1: the fp32 master weights and the optimizer state are partitioned over data parallelism.

Why: under plain DP every replica holds AdamW's two moments and (bf16 parameters) an fp32 copy,
12 of the 16+ bytes/param of training state. ZeRO-1 keeps 1/dp of them per rank for the same
traffic (a reduce-scatter plus an all-gather is what an all-reduce is).

Layout: each gradient bucket of `GradReducer` (one flat buffer, padded to a multiple of dp,
never mixing param groups) is split into dp contiguous slices; rank r owns slice r of every
bucket. A param group's *flat shard* is the concatenation of its slices; the inner optimizer
(the user's class and hyperparameters, so the fused / foreach kernel chosen steps it in one
launch) runs on one fp32 `nn.Parameter` per group holding it, with the reduce-scattered
gradient shard as ``.grad``. The inner optimizer being elementwise (AdamW, Adam, SGD), stepping
the slices is exactly stepping the model; padding stays zero. Unlike ``torch.optim``, a
parameter without a gradient steps with a zero one (momentum and weight decay still move it,
as with DDP and Megatron's distributed optimizer): keep frozen parameters out.

Master weights (``grad_dtype``, ``bf16-master``): the model computes with bf16 weights while the
gradients accumulate in fp32 buckets apart from ``.grad`` (`GradReducer`'s main gradients) and
the masters step in fp32. After the step the weights are refreshed from the masters in *their*
dtype: the all-gather moves bf16, one bucket at a time, asynchronously; with
`overlap_weight_gather` each bucket is waited for in the forward pre-hook of the first module
holding one of its parameters (launched in that order), so the gather runs under the next
forward. One rank (``group`` None: a single process, or dp=1) is the one-shard case: the masters
are a full copy, the gradient shards are the buckets themselves (no second fp32 copy: 4 + 12
bytes/param under bf16-master) and no collective runs. `master_weights_in_model` lends the model the fp32
masters for a checkpoint, so what is saved and loaded is fp32 in any precision.

LR schedulers were built on the user's optimizer before the strategy wrapped it, so the wrapper
keeps it as its front: ``param_groups`` *is* its list, copied into the inner groups at every
`step`. `state_dict` / `load_state_dict` use the single-device ``torch.optim`` format (full
tensors per parameter): a checkpoint saved at any dp loads at any other, with or without ZeRO.
"""

from __future__ import annotations

import inspect
from collections.abc import Collection, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from nanolight.parallel.data_parallel import DEFAULT_BUCKET_BYTES, Bucket, GradReducer, all_gather_single


class ZeroOptimizer:
    """ZeRO stage 1 around an elementwise ``torch.optim`` optimizer (see the module docstring).

    `overlap=True` reduces gradients from backward hooks (call ``reducer.require_sync`` /
    ``reducer.finish`` as `parallel/grads.py` does); otherwise, or when they have not been
    reduced yet, `step` reduce-scatters them itself. `deferred`, `grad_dtype` (main gradients:
    the hooks are needed, so `overlap` must stay True): see `GradReducer`. `group` None: one rank.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        group: Any,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        overlap: bool = True,
        deferred: Collection[int] = (),
        grad_dtype: torch.dtype | None = None,
    ) -> None:
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError("ZeRO-1 needs an elementwise optimizer (AdamW, Adam, SGD); LBFGS is not")
        if grad_dtype is not None and not overlap:
            raise ValueError("main gradients (grad_dtype) accumulate in backward hooks: keep overlap=True")
        self.optimizer = optimizer
        self.param_groups: list[dict[str, Any]] = optimizer.param_groups  # the same list: see above
        self.defaults = optimizer.defaults
        self.group = group
        self.reducer = GradReducer(
            [g["params"] for g in self.param_groups],
            group,
            bucket_bytes,
            shard=True,
            deferred=deferred,
            grad_dtype=grad_dtype,
        )
        self.gathered_bytes = 0  # bytes of weights all-gathered into this rank so far (tests, benchmarks)
        self._pending: dict[int, tuple[Tensor, Any]] = {}  # bucket index -> (gathered, work) in flight
        self._gather_order = list(self.reducer.buckets)  # `overlap_weight_gather`: in first-use order
        self._hooks: list[Any] = []
        if not overlap:
            self.reducer.remove()
        device = next((p.device for g in self.param_groups for p in g["params"]), torch.device("cpu"))
        self.master = [
            nn.Parameter(torch.zeros(n, dtype=torch.float32, device=device)) for n in self.reducer.shard_sizes
        ]
        self.reload_master_weights()
        inner_groups = [
            {**_hyper(g), "params": [m]} for g, m in zip(self.param_groups, self.master, strict=True)
        ]
        # every group carries all its hyperparameters; the constructor also gets the user's defaults,
        # so the shards step with the same kernels (fused / foreach) and flags the user asked for
        self.inner = type(optimizer)(inner_groups, **_constructor_defaults(optimizer))
        if optimizer.state:  # the user's optimizer already has state (e.g. loaded): shard it
            self.load_state_dict(optimizer.state_dict())

    @property
    def dp_rank(self) -> int:
        return self.reducer.dp_rank

    @property
    def dp_size(self) -> int:
        return self.reducer.dp_size

    @property
    def master_weights(self) -> bool:
        """The model computes with low-precision copies of the masters (main gradients)."""
        return self.reducer.main_grads

    @property
    def state(self) -> Any:
        """The inner optimizer's state: one entry per param group's flat master shard."""
        return self.inner.state

    # ---- layout ----------------------------------------------------------------------------
    def _pieces(self, bucket: Bucket) -> Iterator[tuple[nn.Parameter, int, int, int]]:
        """(param, start, end, shard position) for each param overlapping this rank's slice of
        `bucket`: flat elements [start, end) of the param sit at that position of the group shard."""
        n = bucket.numel // self.dp_size
        lo, hi = self.dp_rank * n, (self.dp_rank + 1) * n
        for p, off in zip(bucket.params, bucket.offsets, strict=True):
            a, b = max(lo, off), min(hi, off + p.numel())
            if a < b:
                yield p, a - off, b - off, bucket.shard_offset + a - lo

    def reload_master_weights(self) -> None:
        """Copy this rank's slice of the model's weights into the fp32 master shards.

        Call after the weights changed outside `step` (e.g. a checkpoint was loaded into the model).
        """
        self.wait_for_weights()
        with torch.no_grad():
            for bucket in self.reducer.buckets:
                master = self.master[bucket.group_index]
                for p, a, b, pos in self._pieces(bucket):
                    master[pos : pos + b - a].copy_(p.detach().reshape(-1)[a:b])

    def state_numel(self) -> int:
        """Elements of optimizer state held by this rank (e.g. 2 x shard size for AdamW)."""
        return sum(v.numel() for st in self.inner.state.values() for v in st.values() if _is_flat(v))

    def state_bytes(self, include_master: bool = True) -> int:
        """Bytes of optimizer state (and fp32 master weights) this rank holds."""
        total = sum(
            v.numel() * v.element_size()
            for st in self.inner.state.values()
            for v in st.values()
            if _is_flat(v)
        )
        return total + (sum(m.numel() * m.element_size() for m in self.master) if include_master else 0)

    # ---- one step --------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buckets (``set_to_none`` is ignored: ``.grad`` are bucket views)."""
        self.reducer.zero_grad()

    @property
    def shard_grads(self) -> list[Tensor]:
        """This rank's dp-mean gradient shard per param group (after the reduction; at dp=1 the
        group's buckets themselves)."""
        return self.reducer.shard_grads

    def reduced_grads(self) -> list[Tensor]:
        """The gradients `step` updates with (this rank's shard per param group): reduce-scattered
        now unless backward hooks already did it this step. What clipping must change."""
        if not self.reducer.ready:
            self.reducer.finish()
        return list(self.shard_grads)

    def grad_pieces(self, counted: set[int]) -> list[Tensor]:
        """Views of this rank's gradient shard holding the parameters in `counted` (ids), for the
        global norm (`parallel/grads.py`); call after the reduction."""
        shards, pieces = self.reduced_grads(), []
        for bucket in self.reducer.buckets:
            shard = shards[bucket.group_index]
            pieces += [shard[pos : pos + b - a] for p, a, b, pos in self._pieces(bucket) if id(p) in counted]
        return pieces

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """Update this rank's shard with the inner optimizer, then all-gather the new weights."""
        if closure is not None:
            raise ValueError("ZeroOptimizer.step does not support a closure")
        self.wait_for_weights()
        grads = self.reduced_grads()
        for front, inner in zip(self.param_groups, self.inner.param_groups, strict=True):
            inner.update(_hyper(front))  # the LR scheduler changed the front's lr
        for m, g in zip(self.master, grads, strict=True):
            m.grad = g if g.dtype == m.dtype else g.float()
        self.inner.step()
        # LR schedulers warn "scheduler.step() before optimizer.step()" unless the optimizer they
        # hold (the front) records a step: this is the flag their step wrapper sets
        self.optimizer._opt_called = True  # type: ignore[attr-defined]
        for m in self.master:
            m.grad = None
        self._refresh_weights()
        self.reducer.ready = False

    # ---- the weights from the masters -------------------------------------------------------
    def _refresh_weights(self) -> None:
        """Each bucket's weights from the updated masters, in the weights' own dtype (bf16 under
        master weights: half the bytes of fp32). Waited for now, unless `overlap_weight_gather`."""
        for bucket in self._gather_order:
            n = bucket.numel // self.dp_size
            mine = self.master[bucket.group_index][bucket.shard_offset : bucket.shard_offset + n]
            if self.dp_size == 1:  # the master is the whole bucket: no exchange
                self._copy_into_params(bucket, mine)
                continue
            dtype, device = bucket.params[0].dtype, bucket.params[0].device
            full = torch.empty(bucket.numel, dtype=dtype, device=device)
            # dp ranks all-gather their updated slices of the bucket: everyone gets the new weights
            work = all_gather_single(full, mine.to(dtype), group=self.group, async_op=True)
            self.gathered_bytes += full.numel() * full.element_size()
            self._pending[bucket.index] = (full, work)
        if not self._hooks:
            self.wait_for_weights()

    @staticmethod
    @torch.no_grad()
    def _copy_into_params(bucket: Bucket, flat: Tensor) -> None:
        for p, off in zip(bucket.params, bucket.offsets, strict=True):
            p.copy_(flat[off : off + p.numel()].view_as(p))

    def _wait_bucket(self, index: int) -> None:
        full, work = self._pending.pop(index)
        work.wait()
        self._copy_into_params(self.reducer.buckets[index], full)

    @property
    def gathers_in_flight(self) -> int:
        """Buckets whose post-step all-gather has not been waited for yet (the next forward will)."""
        return len(self._pending)

    def wait_for_weights(self) -> None:
        """Finish every weight all-gather still in flight (before reading the weights outside a forward)."""
        for index in [b.index for b in self._gather_order if b.index in self._pending]:
            self._wait_bucket(index)

    def overlap_weight_gather(self, modules: Iterable[nn.Module], last: nn.Module) -> None:
        """Wait for each bucket's all-gather in the forward pre-hook of the first of `modules`
        that holds one of its parameters, and for any still in flight after `last`'s forward (a
        weight read outside its own module, as a fused loss reads the head's): every forward
        that reads such a weight must run `last` first (a model's last block does). `modules` in
        registration order (a model's forward order): the gathers are launched in the order of
        their first holder, the order the next forward needs them."""
        modules = list(modules)
        buckets_of: dict[int, set[int]] = {}
        for b in self.reducer.buckets:
            for p in b.params:
                buckets_of.setdefault(id(p), set()).add(b.index)
        first_use: dict[int, int] = {}  # bucket index -> position of its first holder in `modules`
        for pos, module in enumerate(modules):
            for p in module.parameters(recurse=False):
                for index in buckets_of.get(id(p), ()):
                    first_use.setdefault(index, pos)
        self._gather_order.sort(
            key=lambda b: first_use.get(b.index, len(modules))
        )  # the same on every dp rank

        def waiter(indices: list[int]) -> Any:
            def hook(*_: Any) -> None:
                for index in indices:
                    if index in self._pending:
                        self._wait_bucket(index)

            return hook

        for module in modules:
            indices = sorted({i for p in module.parameters(recurse=False) for i in buckets_of.get(id(p), ())})
            if indices:
                self._hooks.append(module.register_forward_pre_hook(waiter(indices)))
        self._hooks.append(last.register_forward_hook(lambda *_: self.wait_for_weights()))

    @contextmanager
    def master_weights_in_model(self) -> Iterator[None]:
        """For the duration the model's parameters hold the fp32 masters (full tensors, gathered
        over dp: collective), e.g. to save or load a checkpoint; on exit the compute weights are
        set from whatever the parameters then hold (a load)."""
        self.wait_for_weights()
        full: dict[int, Tensor] = {}
        for g_idx, master in enumerate(self.master):
            full.update(self._gather_flat(master.detach(), g_idx))
        params = [p for b in self.reducer.buckets for p in b.params]
        compute = {id(p): p.data for p in params}
        for p in params:
            p.data = full[id(p)].to(p.device)
        try:
            yield
        finally:
            with torch.no_grad():
                for p in params:
                    fp32, p.data = p.data, compute[id(p)]
                    p.copy_(fp32)

    # ---- checkpoints: the single-device torch.optim format -------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Full per-parameter state, as ``torch.optim`` saves it on one device (collective: every
        dp rank must call it; every rank gets the full state)."""
        state: dict[int, dict[str, Any]] = {}
        groups, index = [], 0
        for g_idx, front in enumerate(self.param_groups):
            shard_state = self.inner.state.get(self.master[g_idx], {})
            full = {k: self._gather_flat(v, g_idx) for k, v in shard_state.items() if _is_flat(v)}
            ids = []
            for p in front["params"]:
                if shard_state:
                    state[index] = {
                        k: (full[k][id(p)] if k in full else (v.clone() if isinstance(v, Tensor) else v))
                        for k, v in shard_state.items()
                    }
                ids.append(index)
                index += 1
            groups.append({**_hyper(front), "params": ids})
        return {"state": state, "param_groups": groups}

    def owned_ranges(self) -> dict[int, tuple[int, int]]:
        """id(param) -> the flat range [start, end) of it in this rank's partition (one range:
        a partition is a contiguous slice of a bucket). Loading reads only these elements."""
        return {id(p): (a, b) for bucket in self.reducer.buckets for p, a, b, _ in self._pieces(bucket)}

    def local_state_pieces(self) -> Iterator[tuple[nn.Parameter, int, int, dict[str, Any]]]:
        """This rank's partition of the optimizer state, per parameter, for sharded checkpoints:
        (param, start, end, {state key: value}) where tensors are the flat elements [start, end)
        of the param's state (views, no copy) and scalars (e.g. Adam's ``step``) are as stored.
        No communication: each dp rank writes its own pieces."""
        for bucket in self.reducer.buckets:
            shard_state = self.inner.state.get(self.master[bucket.group_index], {})
            if not shard_state:
                continue
            for p, a, b, pos in self._pieces(bucket):
                yield p, a, b, {k: v[pos : pos + b - a] if _is_flat(v) else v for k, v in shard_state.items()}

    def _gather_flat(self, shard: Tensor, g_idx: int) -> dict[int, Tensor]:
        """All-gather a flat per-group state shard; return it split per parameter (id -> tensor)."""
        gathered = shard
        if self.dp_size > 1:
            gathered = torch.empty(self.dp_size * shard.numel(), dtype=shard.dtype, device=shard.device)
            # dp ranks all-gather their shards of this state tensor (e.g. exp_avg) for the checkpoint
            all_gather_single(gathered, shard.contiguous(), group=self.group)
        gathered = gathered.view(self.dp_size, -1)
        out = {}
        for bucket in self.reducer.buckets:
            if bucket.group_index != g_idx:
                continue
            n = bucket.numel // self.dp_size
            flat = gathered[:, bucket.shard_offset : bucket.shard_offset + n].reshape(-1)
            for p, off in zip(bucket.params, bucket.offsets, strict=True):
                out[id(p)] = flat[off : off + p.numel()].view_as(p).cpu().clone()
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the single-device format (saved at any dp, with or without ZeRO); local, no collective."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
            len(s["params"]) != len(f["params"]) for s, f in zip(saved_groups, self.param_groups, strict=True)
        ):
            raise ValueError(
                "optimizer state does not match: the checkpoint has param groups of sizes "
                f"{[len(s['params']) for s in saved_groups]}, the optimizer "
                f"{[len(f['params']) for f in self.param_groups]}"
            )
        saved_state = {int(k): v for k, v in state_dict["state"].items()}
        for g_idx, (front, saved) in enumerate(zip(self.param_groups, saved_groups, strict=True)):
            front.update(_hyper(saved))  # in place: the LR scheduler holds these dicts
            entries = {
                id(p): saved_state[int(i)]
                for p, i in zip(front["params"], saved["params"], strict=True)
                if int(i) in saved_state
            }
            master = self.master[g_idx]
            if not entries:
                self.inner.state.pop(master, None)
                continue
            first = next(iter(entries.values()))
            shard: dict[str, Any] = {}
            inner = self.inner.param_groups[g_idx]
            on_device = inner.get("fused") or inner.get("capturable")
            for key, value in first.items():
                if isinstance(value, Tensor) and value.dim() > 0:
                    shard[key] = torch.zeros_like(master, dtype=master.dtype)
                elif isinstance(value, Tensor) and key == "step" and on_device:
                    # fused / capturable kernels keep the step count in fp32 on the params' device
                    # (where torch.optim's own load_state_dict moves it)
                    shard[key] = value.to(device=master.device, dtype=torch.float32)
                else:
                    shard[key] = value.clone() if isinstance(value, Tensor) else value
            for bucket in self.reducer.buckets:
                if bucket.group_index != g_idx:
                    continue
                for p, a, b, pos in self._pieces(bucket):
                    for key, value in entries.get(id(p), {}).items():
                        if isinstance(value, Tensor) and value.dim() > 0:
                            shard[key][pos : pos + b - a].copy_(value.reshape(-1)[a:b])
            self.inner.state[master] = shard

    def __repr__(self) -> str:
        return f"ZeroOptimizer(stage=1, dp={self.dp_size}, inner={type(self.inner).__name__})"


def masters_in_model(optimizers: Iterable[Any]) -> ExitStack:
    """Under ``bf16-master`` the model holds its fp32 master weights for the duration (a checkpoint
    saves and loads those: any precision reads them): each of `optimizers` that is a `ZeroOptimizer`
    keeping masters lends them (collective over its dp group); otherwise nothing."""
    stack = ExitStack()
    for opt in optimizers:
        if isinstance(opt, ZeroOptimizer) and opt.master_weights:
            stack.enter_context(opt.master_weights_in_model())
    return stack


def _constructor_defaults(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The user's optimizer's defaults that its constructor takes (fused, foreach, capturable,
    lr, ...); defaults a constructor does not take (AdamW's ``decoupled_weight_decay``) are left out."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"}


def _hyper(group: dict[str, Any]) -> dict[str, Any]:  # a param group's hyperparameters
    return {k: v for k, v in group.items() if k != "params"}


def _is_flat(value: Any) -> bool:
    """A per-element state tensor (e.g. exp_avg) rather than a scalar such as `step`."""
    return isinstance(value, Tensor) and value.dim() > 0
