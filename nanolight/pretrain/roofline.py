"""The dry run's step time: each operator of a rank's real program priced on a named GPU.

torch's ``RuntimeEstimator`` has the roofline (an operator takes its FLOPs at the peak or its bytes
at the memory bandwidth, whichever is longer) but asks the CUDA device at hand for both, so it
cannot price a GPU this machine lacks; and its byte count, every tensor in and out, is written for
GPU programs. The dry run runs the CPU's program, which a GPU run differs from where it matters
here: views and device queries that pass the dispatcher, and attention kernels the flop registry
does not know. What the GPU run pays is counted, the rest is not (`moved_bytes`, `CUDA_KERNEL`).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.distributed._tools.fake_collectives import collective_ops
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils._runtime_estimation import _VIEW_OPS, get_num_bytes
from torch.utils.flop_counter import flop_registry

from nanolight.planner.hardware import Hardware

# The CPU's attention kernels, which a GPU run replaces with CUDA's flash kernels: FLOPs by those
# kernels' formulas (torch's flop registry has none for the CPU ones, so attention counted nothing)
aten = torch.ops.aten
CUDA_KERNEL = {
    aten._scaled_dot_product_flash_attention_for_cpu: aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: aten._scaled_dot_product_flash_attention_backward,
}
OVERWRITES = (aten.copy_, aten.zero_, aten.fill_)  # in-place operators that write without reading
# indexing operators touch only the elements their index addresses in the indexed tensor, not all of
# it (the fused loss's target logits: one of each row's 49,152, not the 3.2 GB (n, V) logits):
# operator -> (the indexed argument, the index argument, whether each index addresses a row)
INDEXED = {
    aten.gather: ("self", "index", False),
    aten.scatter_add_: ("self", "index", False),
    aten.embedding: ("weight", "indices", True),
}
ALLOCATES = (aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty)  # memory, never touched
# operators that hand the host a tensor's value, or a shape that depends on one (`.item()`, `bool()`,
# `nonzero`): on a GPU the host waits there for the device to finish everything queued before
HOST_SYNCS = (aten._local_scalar_dense, aten.nonzero, aten.is_nonzero, aten.equal)


def moved_bytes(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """Bytes an operator reads and writes in device memory, from its schema: each tensor argument
    is read once, a mutated one written too (and not read when overwritten: ``copy_``, ``zero_``,
    an ``out=`` buffer); a fresh output is written. A returned alias of an argument (a view, an
    in-place result) moves nothing of its own, and an operator that writes no tensor -- a view
    (``slice``; ``_unsafe_view``, whose schema does not say so), a metadata query
    (``prim::device``), an allocation (``empty``) -- moves nothing at all. torch's roofline
    sums every tensor in and out instead, which in the dry run's step charged 1.2 TB of views and
    device queries (twenty times the step's real traffic, at smollm-1.7b) and in-place results twice.
    An indexing operator (`INDEXED`) moves only what its index addresses in the indexed tensor."""
    if func._overloadpacket in _VIEW_OPS or func._overloadpacket in ALLOCATES:  # views torch's list names
        return 0
    schema = func._schema
    values = {
        a.name: kwargs.get(a.name) if a.kwarg_only or i >= len(args) else args[i]
        for i, a in enumerate(schema.arguments)
    }
    indexed = INDEXED.get(func._overloadpacket)
    reads = writes = 0
    for a in schema.arguments:
        value = values[a.name]
        nbytes = sum(get_num_bytes(t) for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))
        if indexed is not None and a.name == indexed[0]:  # the addressed elements (or rows) only
            row = value.numel() // value.shape[0] if indexed[2] else 1
            nbytes = values[indexed[1]].numel() * row * value.element_size()
        if a.alias_info is None:
            reads += nbytes
        elif a.alias_info.is_write:
            writes += nbytes
            reads += 0 if a.kwarg_only or func._overloadpacket in OVERWRITES else nbytes
    results = out if len(schema.returns) > 1 else () if not schema.returns else (out,)
    for r, value in zip(schema.returns, results, strict=True):
        if r.alias_info is None:
            writes += sum(get_num_bytes(t) for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))
    return reads + writes if writes else 0


class Roofline(TorchDispatchMode):
    """Each operator's time on `hw`: its FLOPs at the peak for its dtype, or its bytes read and
    written at the memory bandwidth, whichever is longer (``RuntimeEstimator``'s roofline, priced
    for a named GPU rather than the one at hand, its bytes by `moved_bytes` and the CPU's attention
    kernels counted as CUDA's). `ops` keeps where the estimate goes, per step and operator;
    `bound_bytes` the bytes of the operators priced by their bytes (memory-bound), per step: what the
    planner's bytes terms are measured against (its matmuls are priced by their FLOPs instead).

    `table_seconds` prices the same operators with their FLOPs at the rate the hardware table says
    matmuls reach (`Hardware.efficiency` of the peak), which the planner's compute uses: no GPU runs
    its matmuls at the datasheet's peak, and an order of layouts that weighs compute against
    communication moves with that rate, so a comparison shows both. `host_syncs` counts the
    `HOST_SYNCS` per step."""

    def __init__(self, hw: Hardware) -> None:
        super().__init__()
        self.hw = hw
        self.step = 0
        self.seconds: dict[int, float] = defaultdict(float)
        self.table_seconds: dict[int, float] = defaultdict(float)
        self.host_syncs: dict[int, int] = defaultdict(int)
        self.flops: dict[int, float] = defaultdict(float)
        self.bound_bytes: dict[int, float] = defaultdict(float)
        # step -> operator -> [seconds, FLOPs, bytes, calls]
        self.ops: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0] * 4))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func._overloadpacket in HOST_SYNCS:
            self.host_syncs[self.step] += 1
        out = func(*args, **kwargs)
        if func in collective_ops:
            return out
        nbytes = moved_bytes(func, args, kwargs, out)
        packet = CUDA_KERNEL.get(func._overloadpacket, func._overloadpacket)
        flops = compute = 0.0
        if packet in flop_registry:
            flops = flop_registry[packet](*args, **kwargs, out_val=out)
            low = any(
                isinstance(t, torch.Tensor) and t.dtype in (torch.bfloat16, torch.float16)
                for t in tree_flatten(out)[0]
            )
            self.flops[self.step] += flops
            compute = flops / (self.hw.bf16_flops if low else self.hw.fp32_flops)
        seconds = max(compute, nbytes / self.hw.memory_bandwidth)
        self.table_seconds[self.step] += max(compute / self.hw.efficiency, nbytes / self.hw.memory_bandwidth)
        if nbytes and compute * self.hw.memory_bandwidth <= nbytes:
            self.bound_bytes[self.step] += nbytes
        if seconds:
            self.seconds[self.step] += seconds
            row = self.ops[self.step][str(func)]
            for i, v in enumerate((seconds, flops, nbytes, 1)):
                row[i] += v
        return out
