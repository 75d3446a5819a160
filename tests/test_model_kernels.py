"""The model's eager fast paths against the plain formulas they replace (same numbers).

The fused head + loss (`models/fused_loss.py`) against ``F.cross_entropy`` on full logits, the
RoPE, RMSNorm and SwiGLU autograd Functions against the plain-op versions (which `torch.compile`
uses), the CPU MLP's regrouped projection against the stride-2 unbinding; and the attention
kernel calls the model makes on CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from nanolight.models import LlamaConfig, LlamaForCausalLM
from nanolight.models.fused_loss import linear_cross_entropy
from nanolight.models.llama import RMSNorm, SwiGLU, _rms_plain, _SwiGLU
from nanolight.models.llama_rope import _Rope, apply_rope, rope_cos_sin, rope_inv_freq, rope_qkv


def _grads(fn, *tensors):
    for t in tensors:
        t.grad = None
    out = fn()
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))  # the same each call
    out.backward(upstream if out.dim() else None)
    return out.detach(), [t.grad.clone() for t in tensors]


@pytest.mark.parametrize("rows", [3, 16, None])
def test_fused_head_loss_matches_cross_entropy(rows):
    torch.manual_seed(0)
    h = torch.randn(2, 8, 16, requires_grad=True)
    w = (0.1 * torch.randn(50, 16)).requires_grad_()
    labels = torch.randint(0, 50, (2, 8))
    labels[0, :3] = -100  # ignored tokens count neither in the mean nor in the gradient
    ref, (gh, gw) = _grads(lambda: F.cross_entropy((h @ w.t()).flatten(0, 1), labels.flatten()), h, w)
    out, (fh, fw) = _grads(lambda: 3.0 * linear_cross_entropy(h, w, labels, rows), h, w)
    torch.testing.assert_close(out, 3.0 * ref)
    torch.testing.assert_close(fh, 3.0 * gh)
    torch.testing.assert_close(fw, 3.0 * gw)


def test_fused_head_loss_under_bf16_autocast_and_no_grad():
    torch.manual_seed(0)
    h = torch.randn(12, 32, requires_grad=True)
    w = (0.1 * torch.randn(40, 32)).requires_grad_()
    labels = torch.randint(0, 40, (12,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, (gh, gw) = _grads(lambda: F.cross_entropy((h @ w.t()).float(), labels), h, w)
        out, (fh, fw) = _grads(lambda: linear_cross_entropy(h, w, labels, 5), h, w)
    assert out.dtype == torch.float32 and fh.dtype == h.dtype and fw.dtype == w.dtype
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(fh, gh, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(fw, gw, rtol=2e-2, atol=2e-3)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h, w, labels, 5), F.cross_entropy(h @ w.t(), labels))


def test_fused_head_loss_takes_no_gradients_under_no_grad():
    """Validation runs under no_grad: no backward will come, so the only matmul is the logits'
    (2·N·H·V FLOPs, counted by PyTorch's FlopCounterMode), not d hidden's nor d weight's."""
    from torch.utils.flop_counter import FlopCounterMode

    n, hidden, vocab = 24, 32, 40
    h = torch.randn(n, hidden, requires_grad=True)
    w = torch.randn(vocab, hidden, requires_grad=True)
    labels = torch.randint(0, vocab, (n,))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        loss = linear_cross_entropy(h, w, labels, rows=8)
    assert not loss.requires_grad
    assert counter.get_total_flops() == 2 * n * hidden * vocab
    with FlopCounterMode(display=False) as counter:  # training: the counter sees the gradients' matmuls
        linear_cross_entropy(h, w, labels, rows=8)
    assert counter.get_total_flops() > 2 * 2 * n * hidden * vocab


@pytest.mark.parametrize("gathered", [False, True])
def test_fused_head_loss_holds_one_chunk_of_logits_at_a_time(gathered):
    """Two chunks of n/2 tokens peak at least a half chunk's fp32 logits (4 * n/2 * V bytes) under
    one chunk of n (torch's MemTracker, real tensors): a chunk's logits are gone before the next
    chunk's are made. `gathered`: the vocab-parallel path the strategy takes (one slice here)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    n, hidden, vocab = 64, 16, 1024
    h = torch.randn(n, hidden, requires_grad=True)
    w = torch.randn(vocab, hidden, requires_grad=True)
    labels = torch.randint(0, vocab, (n,))
    gather = (lambda stats: stats[None]) if gathered else None

    def peak(rows: int) -> int:
        with MemTracker() as tracker:
            linear_cross_entropy(h, w, labels, rows, gather=gather)
        return tracker.get_tracker_snapshot("peak")[h.device]["Total"]

    assert peak(n) - peak(n // 2) >= 4 * (n // 2) * vocab


def test_rope_function_matches_plain_rotation():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 3, 2, 16, requires_grad=True)  # (B, T, n_kv, r, head_dim)
    cos, sin = rope_cos_sin(torch.arange(7)[None], rope_inv_freq(16, 1e4, None), x.dtype)
    c, s = cos[..., :8].reshape(1, 7, 1, 1, 8), sin[..., :8].reshape(1, 7, 1, 1, 8)

    def plain():
        x1, x2 = x[..., :8], x[..., 8:]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)

    ref, (g_ref,) = _grads(plain, x)
    out, (g_out,) = _grads(lambda: _Rope.apply(x, cos.reshape(1, 7, 1, 1, 16), s), x)  # cos: full width
    assert out.is_contiguous()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(g_out, g_ref)


@pytest.mark.parametrize("n_kv, r", [(1, 3), (2, 2), (3, 1)])
def test_qkv_rotation_matches_split_and_plain_rotation(n_kv, r):
    """q, k rotated and v passed on from the fused projection's output, gradients written into one
    buffer: the plain rotation's numbers, and bit for bit those of splitting qkv and rotating q
    and k apart (`apply_rope`, autograd joining the gradients)."""
    torch.manual_seed(0)
    qkv = torch.randn(2, 7, n_kv, r + 2, 16, requires_grad=True)  # (B, T, n_kv, r + 2, head_dim)
    cos, sin = rope_cos_sin(torch.arange(7)[None], rope_inv_freq(16, 1e4, None), qkv.dtype)
    c, s = cos[..., :8].reshape(1, 7, 1, 1, 8), sin[..., :8].reshape(1, 7, 1, 1, 8)

    def rotated(x):
        x1, x2 = x[..., :8], x[..., 8:]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)

    def plain():
        q, k, v = qkv.split((r, 1, 1), dim=3)
        return torch.cat((rotated(q).flatten(2, 3), rotated(k).squeeze(3), v.squeeze(3)), dim=2)

    def fused():
        q, k, v = rope_qkv(qkv, cos, sin)
        assert q.shape == (2, 7, n_kv * r, 16) and k.shape == v.shape == (2, 7, n_kv, 16)
        return torch.cat((q, k, v), dim=2)

    def apart():
        q, k, v = qkv.split((r, 1, 1), dim=3)
        q, k = apply_rope(q, cos, sin).flatten(2, 3), apply_rope(k.squeeze(3), cos, sin)
        return torch.cat((q, k, v.squeeze(3)), dim=2)

    ref, (g_ref,) = _grads(plain, qkv)
    out, (g_out,) = _grads(fused, qkv)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(g_out, g_ref)
    same, (g_same,) = _grads(apart, qkv)
    assert torch.equal(out, same) and torch.equal(g_out, g_same)


def test_rope_keeps_the_input_dtype_under_autocast():
    """Under bf16 autocast the tables are fp32 and q, k the projections' bf16: the rotation is
    computed in fp32 and rounded once to bf16 -- q, k and v reach attention in one dtype (flash-attn
    takes nothing else) -- in the eager Function and in the plain ops `torch.compile` traces."""
    torch.manual_seed(0)
    x = torch.randn(2, 9, 3, 16).bfloat16().requires_grad_()
    cos, sin = rope_cos_sin(torch.arange(9)[None], rope_inv_freq(16, 1e4, None), torch.float32)
    xf = x.detach().float()
    c, s = cos[..., :8].reshape(1, 9, 1, 8), sin[..., :8].reshape(1, 9, 1, 8)
    ref = torch.cat((xf[..., :8] * c - xf[..., 8:] * s, xf[..., 8:] * c + xf[..., :8] * s), dim=-1).bfloat16()
    out = apply_rope(x, cos, sin)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    out.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16


def test_rmsnorm_function_matches_plain_formula():
    torch.manual_seed(0)
    norm = RMSNorm(32, 1e-5)
    with torch.no_grad():
        norm.weight.mul_(torch.rand(32) + 0.5)
    x = torch.randn(3, 5, 32, requires_grad=True)
    ref, g_ref = _grads(lambda: _rms_plain(x, norm.weight, norm.eps), x, norm.weight)
    out, g_out = _grads(lambda: norm(x), x, norm.weight)
    torch.testing.assert_close(out, ref)
    for a, b in zip(g_out, g_ref, strict=True):
        torch.testing.assert_close(a, b)


def test_mlp_reads_gate_then_up_rows():
    """gate_up_proj's rows are [gate | up]: the MLP is Llama's down(silu(x Wg^T) * x Wu^T) with Wg
    its first half and Wu its second, values and gradients."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=10, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4
    )
    mlp = SwiGLU(cfg)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 5, 32, requires_grad=True)

    def separate():
        w_gate, w_up = mlp.gate_up_proj.weight[:48], mlp.gate_up_proj.weight[48:]
        return mlp.down_proj(F.silu(x @ w_gate.T) * (x @ w_up.T))

    params = (x, mlp.gate_up_proj.weight, mlp.down_proj.weight)
    ref, g_ref = _grads(separate, *params)
    out, g_out = _grads(lambda: mlp(x), *params)
    torch.testing.assert_close(out, ref)
    for a, b in zip(g_out, g_ref, strict=True):
        torch.testing.assert_close(a, b)


def test_swiglu_function_matches_autograd_bit_for_bit():
    """One gradient buffer instead of two joined by a copy: the same ops, so the same bits."""
    torch.manual_seed(0)
    gate_up = torch.randn(2, 5, 24, requires_grad=True)

    def plain():
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    ref, (g_ref,) = _grads(plain, gate_up)
    out, (g_out,) = _grads(lambda: _SwiGLU.apply(gate_up), gate_up)
    assert torch.equal(out, ref) and torch.equal(g_out, g_ref)


class _AttentionOps(TorchDispatchMode):
    """The attention kernels the model dispatches, by aten name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "attention" in func.overloadpacket.__name__:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("documents", [False, True])
def test_the_models_cpu_attention_is_one_sdpa_call_per_layer(documents):
    """The model's SDPA attention on CPU is what it is on a GPU: one SDPA call per layer, forward
    and backward (with packed documents under their mask), no path that exists for CPU speed;
    grouped-query K/V go to the kernel as they are. The result is SDPA's over the whole
    sequence, which the parity tests (`test_model_attention.py`, `test_model_documents.py`) hold
    against transformers."""
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (2, 200))
    doc_ids = torch.arange(200).div(50, rounding_mode="floor").expand(2, 200) if documents else None
    with _AttentionOps() as kernels:
        model(ids, labels=ids, document_ids=doc_ids).backward()
    flash = "_scaled_dot_product_flash_attention_for_cpu"
    assert kernels.ops == [flash] * 2 + [flash + "_backward"] * 2
