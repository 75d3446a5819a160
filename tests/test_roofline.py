"""The dry run's roofline (`nanolight/pretrain/roofline.py`) prices what a GPU run pays: an
operator's bytes are what it reads and writes (a view or a device query moves nothing, an
in-place result is not a second write), and the CPU's flash attention counts the FLOPs torch's
own counter gives the same attention written as matmuls (and the scores again: flash's backward
recomputes them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from nanolight.planner.hardware import hardware
from nanolight.pretrain.roofline import Roofline

HW = hardware("h100-sxm")


def _measured(fn) -> Roofline:
    roofline = Roofline(HW)
    with roofline:
        fn()
    return roofline


def _bytes(roofline: Roofline) -> float:
    return sum(row[2] for row in roofline.ops[0].values())


def test_views_and_device_queries_move_nothing() -> None:
    x = torch.randn(64, 256)

    def views() -> None:
        x[:, :128].unsqueeze(0)
        x[:32].view(-1)
        x.t()
        # what `tensor.device` dispatches to under fake tensors (10,133 calls, 0.9 TB, in one
        # smollm-1.7b step once)
        assert torch.ops.prim.device.default(x).type == "cpu"
        torch.empty(1024, 1024)

    roofline = _measured(views)
    assert _bytes(roofline) == 0 and roofline.seconds[0] == 0.0


def test_each_tensor_is_read_or_written_once() -> None:
    a, b, c = (torch.randn(128, 128) for _ in range(3))
    size = a.numel() * a.element_size()
    cases = {
        "copy_": (lambda: c.copy_(a), 2),  # read a, write c
        "zero_": (lambda: c.zero_(), 1),  # write c
        "add_": (lambda: c.add_(a), 3),  # read c and a, write c
        "mul out=": (lambda: torch.mul(a, b, out=c), 3),  # read a and b, write c
        "add": (lambda: torch.add(a, b), 3),  # read a and b, write the result
    }
    for name, (fn, tensors) in cases.items():
        roofline = _measured(fn)
        assert _bytes(roofline) == tensors * size, name
        assert roofline.seconds[0] == tensors * size / HW.memory_bandwidth, name


def test_cpu_flash_attention_counts_the_attention_matmuls() -> None:
    q, k, v = (torch.randn(2, 4, 128, 32, requires_grad=True) for _ in range(3))

    def sdpa() -> None:
        F.scaled_dot_product_attention(q, k, v).sum().backward()

    def matmuls() -> None:
        scores = (q @ k.transpose(-1, -2) / 32**0.5).softmax(-1)
        (scores @ v).sum().backward()

    counter, recompute = FlopCounterMode(display=False), FlopCounterMode(display=False)
    with counter:
        matmuls()
    with recompute:  # a flash kernel's backward computes the scores again
        q @ k.transpose(-1, -2)
    roofline = _measured(sdpa)
    assert any("flash_attention_for_cpu" in name for name in roofline.ops[0])
    assert roofline.flops[0] == counter.get_total_flops() + recompute.get_total_flops() > 0
