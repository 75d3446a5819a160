"""Ring attention (`parallel/ring_attention.py`, its block kernels `parallel/ring_kernels.py`) against whole-sequence attention in one process.

The reference is PyTorch's own `scaled_dot_product_attention` over the whole sequence (causal, or
with the packed documents' mask), its gradients from autograd. Each cp rank gets its zigzag share
of q, k, v, the document ids and the output gradient; the outputs and q/k/v gradients the ranks
return, put back in sequence order, must equal the reference's. Every exchange is recorded and
checked by NCCL's rules (`_nccl_emulation`).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist import run_distributed
from _nccl_emulation import assert_nccl_safe, install, recording
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from nanolight.models.attention import Documents
from nanolight.parallel.ring_attention import RingAttention, zigzag_positions, zigzag_shard, zigzag_unshard
from nanolight.parallel.ring_kernels import (
    Block,
    CpuFlashKernel,
    CudaFlashKernel,
    FlexKernel,
    MathKernel,
    block_kernel,
)

B, T, D = 2, 32, 16


def _inputs(heads: int, kv_heads: int, documents: bool, dtype: torch.dtype = torch.float32) -> dict:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, heads, T, D, generator=g).to(dtype)
    k = torch.randn(B, kv_heads, T, D, generator=g).to(dtype)
    v = torch.randn(B, kv_heads, T, D, generator=g).to(dtype)
    grad = torch.randn(B, heads, T, D, generator=g).to(dtype)
    ids = None
    if documents:  # documents of uneven lengths whose boundaries fall inside and across chunks
        lengths = [[5, 11, 3, 13], [20, 1, 11]]
        ids = torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in lengths])
    return {"q": q, "k": k, "v": v, "grad": grad, "ids": ids}


def _reference(x: dict) -> tuple[torch.Tensor, ...]:
    q, k, v = (x[n].clone().requires_grad_() for n in "qkv")
    groups = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if x["ids"] is None:
        out = F.scaled_dot_product_attention(q, ke, ve, is_causal=True)
    else:
        out = F.scaled_dot_product_attention(q, ke, ve, attn_mask=Documents(x["ids"]).mask())
    out.backward(x["grad"])
    return out.detach(), q.grad, k.grad, v.grad


class KernelCalls(TorchDispatchMode):
    """The block kernels' calls: (where in the NCCL recording, forward or backward, k's heads)."""

    KERNELS = {"_scaled_dot_product_flash_attention_for_cpu": "forward"}
    KERNELS["_scaled_dot_product_flash_attention_for_cpu_backward"] = "backward"

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = func.overloadpacket.__name__
        if name in self.KERNELS:
            k = args[2] if self.KERNELS[name] == "backward" else args[1]
            self.calls.append((len(recording()), self.KERNELS[name], k.shape[1]))
        return func(*args, **(kwargs or {}))


def _worker(rank: int, world: int, x: dict, autocast: bool = False) -> dict:
    install()
    group = dist.new_group(list(range(world)))
    ring = RingAttention(group, list(range(world)))
    q, k, v = (zigzag_shard(x[n], rank, world, dim=2).requires_grad_() for n in "qkv")
    documents = None if x["ids"] is None else ring.prepare(Documents(zigzag_shard(x["ids"], rank, world)))
    with KernelCalls() as kernels, torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        out = ring.attend(q, k, v, documents)
    with kernels:
        out.backward(zigzag_shard(x["grad"], rank, world, dim=2))
    return {
        "out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "ops": recording(),
        "kernels": kernels.calls,
    }  # fmt: skip


def _whole(shards: list[torch.Tensor]) -> torch.Tensor:
    """Put zigzag shards (dim 2) back in sequence order."""
    return zigzag_unshard(shards, dim=2)


CASES = {
    "cp2-causal": (2, 4, 4, False),
    "cp2-gqa-documents": (2, 4, 2, True),
    "cp4-gqa-documents": (4, 4, 1, True),
    "cp4-causal": (4, 2, 2, False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_ring_attention_equals_whole_sequence_attention(name: str) -> None:
    cp, heads, kv_heads, documents = CASES[name]
    x = _inputs(heads, kv_heads, documents)
    ref = _reference(x)
    got = run_distributed(_worker, cp, x, timeout=300, pg_timeout=120)  # generous: a loaded machine
    for key, want in zip(("out", "dq", "dk", "dv"), ref, strict=True):
        torch.testing.assert_close(_whole([r[key] for r in got]), want, rtol=1e-5, atol=1e-5, msg=key)
    assert_nccl_safe([r["ops"] for r in got])
    # grouped-query K/V reach the kernel as they are: no copy per query head
    assert {heads for r in got for _, _, heads in r["kernels"]} == {kv_heads}


def test_zigzag_positions_balance_the_causal_triangle() -> None:
    cp, seq = 4, 64
    positions = [zigzag_positions(r, cp, seq) for r in range(cp)]
    assert torch.equal(torch.sort(torch.cat(positions)).values, torch.arange(seq))
    work = [int((p + 1).sum()) for p in positions]  # keys each rank's queries attend to
    assert len(set(work)) == 1, work
    with pytest.raises(ValueError, match="divisible by 8"):
        zigzag_shard(torch.zeros(1, 60), 0, cp)


def test_ring_attention_in_bf16_matches_fp32_attention_to_bf16_precision() -> None:
    """bf16 inputs (what flash-attn and bf16-master feed it): the ring keeps fp32 statistics and
    sums, so it lands within bf16's rounding of fp32 attention over the same (bf16-rounded) inputs,
    while every exchange travels in bf16: K/V forward and backward, and each block's dK/dV home to
    its owner in cp - 1 hops (3 (cp - 1) exchanges a rank, each overlapped by a kernel but the last)."""
    cp = 4
    x = _inputs(4, 2, True, torch.bfloat16)
    ref = _reference(
        {n: (t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in x.items()}
    )
    got = run_distributed(_worker, cp, x, timeout=300, pg_timeout=120)
    for key, want in zip(("out", "dq", "dk", "dv"), ref, strict=True):
        whole = _whole([r[key] for r in got])
        assert whole.dtype == torch.bfloat16, key
        torch.testing.assert_close(whole.float(), want, rtol=2e-2, atol=2e-2, msg=key)
    for r in got:
        ops = r["ops"]
        exchanges = [op for op in ops if op.kind == "batch"]
        assert len(exchanges) == 3 * (cp - 1), ops
        assert {m.dtype for op in exchanges for m in op.msgs} == {"torch.bfloat16"}, ops
        waited = {op.target: op.seq for op in ops if op.kind == "wait"}
        kernels = [at for at, _, _ in r["kernels"]]
        alone = [op.seq for op in exchanges if not any(op.seq < at <= waited[op.seq] for at in kernels)]
        # only the last dK/dV exchange, whose sum is the result, has nothing left to overlap
        assert alone == [exchanges[-1].seq], (ops, kernels)
    assert_nccl_safe([r["ops"] for r in got])  # the cp - 1 homeward sums pair up as NCCL needs


def test_ring_attention_under_autocast_computes_as_without_it() -> None:
    """bf16-mixed: autocast is on around the forward (not around the backward, which autograd
    runs later). The ring's kernels compute in the dtype of the q, k, v they get, both ways: under
    autocast the forward gives what it gives without, and the backward agrees with it. float64
    inputs take the math kernel, whose matmuls autocast would run in bf16."""
    x = _inputs(4, 2, True, torch.float64)
    plain = run_distributed(_worker, 2, x, timeout=300, pg_timeout=120)
    mixed = run_distributed(_worker, 2, x, True, timeout=300, pg_timeout=120)
    for key in ("out", "dq", "dk", "dv"):
        for a, b in zip(plain, mixed, strict=True):
            torch.testing.assert_close(b[key], a[key], rtol=0, atol=0, msg=key)


# ---- the block kernels -------------------------------------------------------------------------


def _block_inputs(dtype: torch.dtype, c: int = 16) -> tuple[torch.Tensor, ...]:
    """q, k, v, dO of one block (grouped-query: 4 heads, 2 kv heads) and the first key each query
    sees (a past chunk's view of packed documents): row 0's first quarter of queries continues the
    key chunk's last document (from key c/4 * 3 on), the rest begin new ones; row 1 sees no key
    at all (its lse is -inf)."""
    g = torch.Generator().manual_seed(1)
    q, do = (torch.randn(2, 4, c, 8, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(2, 2, c, 8, generator=g).to(dtype) for _ in range(2))
    first = torch.full((2, c), c)
    first[0, : c // 4] = c // 4 * 3
    return q, k, v, do, first


def _check_block_kernel(kernel, block: Block, do: torch.Tensor, tol: float = 1e-5) -> None:  # noqa: ANN001
    math = MathKernel()
    out, lse = kernel.forward(block)
    ref_out, ref_lse = math.forward(block)
    torch.testing.assert_close(lse, ref_lse)  # -inf where a row sees no key, in both
    torch.testing.assert_close(out, ref_out)
    # the backward of a block takes the whole row's output and log-sum-exp (here: this block's)
    ref_lse = torch.where(torch.isinf(ref_lse), 0.0, ref_lse)
    got = kernel.backward(block, do, ref_out, ref_lse)
    want = math.backward(block, do, ref_out, ref_lse)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("masked", [True, False])
def test_cpu_flash_block_kernel_matches_the_math_kernel(causal: bool, masked: bool) -> None:
    q, k, v, do, first = _block_inputs(torch.float32)
    first = first if masked else None
    _check_block_kernel(CpuFlashKernel(), Block(q, k, v, causal, first, 0.3), do)


def _autograd_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: Block) -> tuple[torch.Tensor, ...]:
    """A block's output and log-sum-exp as plain differentiable ops (what compiled FlexAttention
    is on a GPU; on CPU it has no backward)."""
    groups = q.shape[1] // k.shape[1]
    s = q @ k.repeat_interleave(groups, 1).transpose(-1, -2) * b.scale
    mask = b.visible()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return p @ v.repeat_interleave(groups, 1), lse


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("masked", [True, False])
def test_flex_block_kernel_matches_the_math_kernel(causal: bool, masked: bool) -> None:
    """`FlexKernel` (CUDA's kernel for documents' and fp32 blocks): its forward is FlexAttention
    under the blocks' key ranges (tiles of 128: two by two here; eager, as CPU runs it), its
    backward autograd's through the recomputed block with the gradients that make the block's
    share of the row's -- checked with the block as plain differentiable ops, since FlexAttention
    has no CPU backward; the GPU runs it compiled (`scripts/gpu_check.py`)."""
    q, k, v, do, first = _block_inputs(torch.float32, c=256)
    block = Block(q, k, v, causal, first if masked else None, 0.3)
    out, lse = FlexKernel().forward(block)
    ref_out, ref_lse = MathKernel().forward(block)
    torch.testing.assert_close(lse, ref_lse)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    _check_block_kernel(FlexKernel(_autograd_math), block, do)


def test_cuda_blocks_take_a_fused_kernel_whatever_the_mask_and_precision() -> None:
    """On CUDA no block goes to the math kernel's fp32 (c x c) scores: bf16/fp16 blocks without
    documents take the flash kernel, documents' blocks and fp32 (`32-true`) ones FlexAttention over
    key ranges. Fake CUDA tensors: no GPU needed to ask which."""
    with FakeTensorMode():
        kinds = {
            (dtype, masked): type(block_kernel(torch.empty(1, 4, 8, 16, device="cuda", dtype=dtype), masked))
            for dtype in (torch.bfloat16, torch.float32)
            for masked in (False, True)
        }
    assert kinds == {
        (torch.bfloat16, False): CudaFlashKernel, (torch.bfloat16, True): FlexKernel,
        (torch.float32, False): FlexKernel, (torch.float32, True): FlexKernel,
    }  # fmt: skip
    assert type(block_kernel(torch.empty(1, 4, 8, 16), True)) is CpuFlashKernel


def test_a_blocks_key_ranges_are_its_documents() -> None:
    """The first key each query of a ring block sees (`RingAttention.pairs`), for every pair of
    chunks of a packed sequence, gives the dense rule: the same document, and on the diagonal
    not in the future."""
    ids = torch.repeat_interleave(torch.arange(6), torch.tensor([3, 9, 1, 14, 2, 3]))[None]  # (1, 32)
    same = Documents(ids).mask()[0, 0]  # (32, 32): causal, same document
    cp = 2
    for rank in range(cp):
        ring = RingAttention.__new__(RingAttention)
        ring.rank, ring.cp = rank, cp
        ring_ids = torch.stack([zigzag_shard(ids, r, cp) for r in range(cp)])
        positions = [zigzag_positions(r, cp, 32) for r in range(cp)]
        for step in range(cp):
            src = (rank - step) % cp
            for qs, ks, causal, first in ring.pairs(step, ring_ids, 16):
                block = Block(torch.empty(1, 1, 8, 8), torch.empty(1, 1, 8, 8), None, causal, first, 1.0)
                want = same[positions[rank][qs]][:, positions[src][ks]]
                assert torch.equal(block.visible()[0, 0], want), (rank, step, qs, ks)


def test_cuda_flash_block_kernel_calls_the_kernel_by_its_schema(monkeypatch: pytest.MonkeyPatch) -> None:
    """`CudaFlashKernel` against a stand-in for PyTorch's CUDA flash kernel: the real op's schema
    (positional order, the 9 outputs the backward takes back) and its input rules (fp16/bf16,
    one dtype, head_dim a multiple of 8 up to 256, unit stride last, fp32 log-sum-exp), computed
    by the CPU flash kernel. The real kernel runs in `scripts/gpu_check.py`."""
    calls = []

    def rules(*tensors: torch.Tensor) -> None:
        assert {t.dtype for t in tensors} <= {torch.bfloat16} and len({t.dtype for t in tensors}) == 1
        assert all(t.stride(-1) == 1 and t.dim() == 4 for t in tensors)
        assert tensors[0].shape[-1] % 8 == 0 and tensors[0].shape[-1] <= 256

    def forward(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):  # noqa: ANN001, ANN202
        rules(q, k, v)
        assert dropout_p == 0.0 and not return_debug_mask
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, is_causal, scale=scale
        )
        calls.append("forward")
        empty = torch.empty(0)
        return out, lse, empty, empty, q.shape[2], k.shape[2], torch.empty(2), torch.empty(0), empty

    def backward(
        do, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset, *, scale=None
    ):  # noqa: ANN001, ANN202, PLR0913
        rules(do, q, k, v, out)
        assert lse.dtype == torch.float32 and lse.is_contiguous() and lse.shape == q.shape[:3]
        assert (max_q, max_k) == (q.shape[2], k.shape[2]) and dropout_p == 0.0 and seed.numel() == 2
        calls.append("backward")
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse, 0.0, is_causal, scale=scale
        )

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention", forward)
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_backward", backward)
    q, k, v, do, _ = _block_inputs(torch.bfloat16)
    fused, math, block = CudaFlashKernel(), MathKernel(), Block(q, k, v, True, None, 0.3)
    out, lse = fused.forward(block)
    ref_out, ref_lse = math.forward(block)
    torch.testing.assert_close(out, ref_out, rtol=2e-2, atol=2e-2)
    got = fused.backward(block, do, ref_out, ref_lse)
    want = math.backward(block, do, ref_out, ref_lse)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2)
    assert calls == ["forward", "backward"]
