"""Precision modes, named as in Lightning: ``32-true``, ``bf16-mixed``, ``bf16-true``, plus
``bf16-master`` (Megatron's and nanotron's pretraining scheme).

``bf16-mixed`` keeps parameters, gradients (so gradient accumulation) and optimizer state in
fp32 and runs the forward under ``torch.autocast(bfloat16)``: only matmuls run in bf16, the
residual stream, norms and pipeline activations stay fp32.
``bf16-true`` casts the parameters themselves (half the memory, no fp32 master weights).
``bf16-master`` computes like ``bf16-true`` (bf16 weights, so bf16 activations end to end and
over the pipeline) and updates like ``bf16-mixed``: the optimizer steps fp32 *master* weights
with fp32 state, gradients accumulate over micro-batches and are reduced over dp in fp32
(Megatron's ``main_grad``; FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``),
and the bf16 weights are refreshed from the masters after each step. The masters live in
`parallel/zero.py`'s ``ZeroOptimizer`` (one process or dp=1 is its one-shard case); checkpoints
hold the fp32 masters, so they load in any precision.

``32-true`` on CUDA lets matmuls and cuDNN use TF32 (``torch.set_float32_matmul_precision
("high")``) unless the user already chose a float32 matmul precision: Lightning only warns,
but every peer trainer on Ampere or newer runs fp32 this way (10-bit mantissa products, fp32
accumulation), and 'highest' is one call away for those who need it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "bf16-master")
_ALIASES = {"32": "32-true", 32: "32-true", "bf16": "bf16-mixed", "bf16-mixed": "bf16-mixed"}


@dataclass
class Precision:
    """How parameters are stored and how the forward computes."""

    mode: str = "32-true"

    def __post_init__(self) -> None:
        self.mode = _ALIASES.get(self.mode, self.mode)
        if self.mode not in PRECISIONS:
            raise ValueError(f"precision={self.mode!r} is not supported; choose one of {PRECISIONS}")

    @property
    def master_weights(self) -> bool:
        """The optimizer steps fp32 master copies of low-precision compute weights (``bf16-master``)."""
        return self.mode == "bf16-master"

    def check_layout(self, zero_stage: int, replicas: int) -> None:
        """``bf16-master`` keeps its fp32 masters in ZeRO-1's optimizer: plain replicas (dp x cp
        ranks holding the same weights) have none."""
        if self.master_weights and zero_stage == 0 and replicas > 1:
            raise ValueError(
                f"precision='bf16-master' keeps its fp32 master weights in the ZeRO-1 optimizer: with {replicas} "
                "replicas (dp x cp) set zero_stage=1 (the same traffic as plain data parallelism, 1/replicas "
                "of the optimizer state)"
            )

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the weights hold while the model computes."""
        return torch.bfloat16 if self.mode in ("bf16-true", "bf16-master") else torch.float32

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Cast parameters for ``bf16-true``; other modes keep fp32 parameters here (``bf16-master``
        casts them once its fp32 masters are taken: `cast_to_compute`)."""
        if self.mode == "bf16-true":
            cast_(module, torch.bfloat16)
        return module

    def cast_to_compute(self, module: nn.Module) -> nn.Module:
        """``bf16-master``: the weights (and floating buffers) become bf16, in place (the same
        Parameter objects: the optimizer and the gradient hooks keep them). Call after the fp32
        masters were copied and with no ``.grad`` held."""
        if self.master_weights:
            cast_(module, self.compute_dtype)
        return module

    def convert_input(self, batch: Any) -> Any:
        """``bf16-true`` / ``bf16-master``: floating-point inputs become bf16 to match the weights."""
        if self.compute_dtype != torch.bfloat16:
            return batch
        # imported here: the model-side scripts (scripts/bench_gpu.py) run bf16-master without it
        from lightning_utilities.core.apply_func import apply_to_collection

        return apply_to_collection(
            batch, torch.Tensor, lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t
        )

    def autocast(self, device: torch.device) -> AbstractContextManager:
        """Forward context: bf16 autocast for ``bf16-mixed``, nothing otherwise."""
        if self.mode == "bf16-mixed":
            return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
        return nullcontext()

    def setup_device(self, device: torch.device) -> None:
        """``32-true`` on CUDA: TF32 matmuls and cuDNN convolutions, unless the user already set a
        float32 matmul precision other than the default (see the module docstring)."""
        if self.mode != "32-true" or device.type != "cuda":
            return
        if torch.get_float32_matmul_precision() == "highest":  # PyTorch's default: not a user choice
            torch.set_float32_matmul_precision("high")
            torch.backends.cudnn.allow_tf32 = True


def cast_(module: nn.Module, dtype: torch.dtype) -> None:
    """``module.to(dtype)`` for floating parameters and buffers, always in place (``.data`` set on
    the same objects): ``nn.Module.to`` swaps fake tensors (the dry run's) for new objects, which
    torch refuses for a parameter something holds a weak reference to."""
    with torch.no_grad():
        for mod in module.modules():
            for param in mod.parameters(recurse=False):
                if param.is_floating_point() and param.dtype != dtype:
                    param.data = param.data.to(dtype)
            for name, buf in mod.named_buffers(recurse=False):
                if buf.is_floating_point() and buf.dtype != dtype:
                    setattr(mod, name, buf.to(dtype))
