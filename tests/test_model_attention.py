"""Attention kernels under every precision, and document masks without a dense T x T mask.

No GPU here, so the GPU paths run on CPU with their rules enforced: a stand-in `flash_attn`
package (`_standins/flash_attn`: flash-attn 2's input checks, SDPA's numbers) selected by the
real build check with CUDA reported available, and FlexAttention's block mask chosen by the
real kernel selection with `fused_document_kernels` reporting a GPU. Each is compared with SDPA
and the dense-mask reference on the same weights.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from _tiny import tiny_config
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention.flex_attention import create_block_mask

import nanolight.models.attention as attention
from nanolight.data import document_fields
from nanolight.models import LlamaForCausalLM
from nanolight.precision import Precision

pytest_plugins = ["_flash_standin"]  # the flash_standin fixture

EOS = 3
INIT = 0.3  # weights large enough that attention moves the loss: dropping the masks moves it ~6%
TOLERANCE = 5e-3  # relative, on the loss: a bf16 attention kernel (every precision here) vs SDPA


def _rows(T: int = 48) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Two packed rows with several documents each (EOS-separated), and their document fields."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(4, 128, (2, T), generator=g)
    rows[0, [5, 17, 30]] = EOS
    rows[1, [0, 11, 12, 40]] = EOS
    return rows, document_fields(rows, EOS)


def _loss(model: LlamaForCausalLM, precision: str, rows: torch.Tensor, fields: dict, backward: bool) -> float:
    p = Precision(precision)
    with p.autocast(rows.device):
        loss = model(rows, labels=rows, **fields)
    if backward:
        loss.backward()
    return float(loss.detach())


def test_standin_rejects_what_flash_attn_rejects(flash_standin) -> None:  # noqa: ANN001
    q = torch.randn(1, 8, 4, 16, dtype=torch.bfloat16)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    flash_standin.flash_attn_func(q, q, q, causal=True)  # the accepted form
    bad = {
        "fp16 and bf16": (q.float(), q.float(), q.float()),
        "query and value": (q, q, q.half()),
        "contiguous last dimension": (q, q, q.transpose(-1, -2).contiguous().transpose(-1, -2)),
        "at most 256": (torch.zeros(1, 8, 4, 264, dtype=torch.bfloat16),) * 3,
        "multiple of 8": (torch.zeros(1, 8, 4, 12, dtype=torch.bfloat16),) * 3,
    }
    for message, (a, b, c) in bad.items():
        with pytest.raises(RuntimeError, match=message):
            flash_standin.flash_attn_func(a, b, c, causal=True)
    flat = q[0]
    flash_standin.flash_attn_varlen_func(flat, flat, flat, cu, cu, 5, 5, causal=True)
    with pytest.raises(RuntimeError, match="int32"):
        flash_standin.flash_attn_varlen_func(flat, flat, flat, cu.long(), cu.long(), 5, 5, causal=True)
    with pytest.raises(RuntimeError, match="Python int"):
        flash_standin.flash_attn_varlen_func(flat, flat, flat, cu, cu, torch.tensor(5), 5, causal=True)


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_flash_attention_trains_under_every_precision(flash_standin, precision: str, packed: bool) -> None:  # noqa: ANN001
    """q, k and v reach the kernel in one fp16/bf16 dtype, forward and backward; the loss is
    SDPA's within the precision's tolerance."""
    torch.manual_seed(0)
    sdpa = LlamaForCausalLM(tiny_config(attn_implementation="sdpa", initializer_range=INIT))
    flash = LlamaForCausalLM(tiny_config(attn_implementation="flash_attention_2", initializer_range=INIT))
    flash.load_state_dict(sdpa.state_dict())
    for model in (sdpa, flash):
        Precision(precision).convert_module(model)
    rows, fields = _rows()
    fields = fields if packed else {}
    ref = _loss(sdpa, precision, rows, fields, backward=False)
    with pytest.warns(UserWarning, match="no fp32 kernel") if precision == "32-true" else nullcontext():
        got = _loss(flash, precision, rows, fields, backward=True)
    kernel = "flash_attn_varlen_func" if packed else "flash_attn_func"
    assert [c["fn"] for c in flash_standin.calls] == [kernel] * flash.config.num_hidden_layers
    # (B, T, heads, head_dim) or (B * T, heads, head_dim), kv heads not repeated (GQA in the kernel)
    assert flash_standin.calls[0]["q"][-2:] == (4, 16) and flash_standin.calls[0]["k"][-2:] == (2, 16)
    assert got == pytest.approx(ref, rel=TOLERANCE)
    if packed:  # the tolerance tells documents kept apart from documents mixed
        assert abs(_loss(sdpa, precision, rows, {}, backward=False) - ref) > 10 * TOLERANCE * ref
    assert all(p.grad is not None and p.grad.dtype == p.dtype for p in flash.parameters())


def _starts_mask(starts: torch.Tensor):  # noqa: ANN202 (a mask_mod)
    return lambda b, h, q, kv: (kv <= q) & (kv >= starts[b, q])


@pytest.mark.parametrize("T", [256, 300])
def test_document_block_mask_is_flex_attentions_own(T: int) -> None:
    """The tile-level mask built from document starts, against PyTorch's `create_block_mask`
    (which evaluates every (query, key) pair); equal up to how the tail tile of a length not a
    multiple of 128 is classified (flex never reads its padded rows), so compared as dense
    token masks there."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 60, (3, T), generator=g)
    ids[0] = 5  # one document longer than a tile: full tiles
    documents = attention.Documents(document_fields(ids, EOS)["document_ids"])
    ours = documents.block_mask()
    theirs = create_block_mask(_starts_mask(documents.starts()), 3, None, T, T, device="cpu")
    if T % 128 == 0:
        torch.testing.assert_close(ours.to_dense(), theirs.to_dense())
        full = ours.full_kv_num_blocks
        assert full is not None and torch.equal(full, theirs.full_kv_num_blocks) and int(full.sum()) > 0
    dense = documents.mask()[:, 0]  # (B, T, T) reference
    q, kv = torch.arange(T)[:, None], torch.arange(T)[None, :]
    mask_mod = ours.mask_mod
    for b in range(3):
        token_mask = mask_mod(torch.tensor(b), torch.tensor(0), q, kv)
        tiles = ours.to_dense()[b, 0].repeat_interleave(128, 0).repeat_interleave(128, 1)[:T, :T].bool()
        assert torch.equal(token_mask & tiles, dense[b])  # the tiles cover every allowed pair


def test_document_masks_on_a_gpu_use_flex_attention_without_a_dense_mask(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a GPU reported, SDPA's document masking goes to FlexAttention's block mask: the
    dense (B, 1, T, T) mask is never built, and the losses are the dense reference's. (CPU
    FlexAttention has no backward: forward only here.)"""
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(attn_implementation="sdpa", initializer_range=INIT)).eval()
    rows, fields = _rows(T=300)
    with torch.no_grad():
        reference = model(rows, labels=rows, **fields)
        ref_logits = model(rows, **fields)
    monkeypatch.setattr(attention, "fused_document_kernels", lambda device: True)
    built = []
    monkeypatch.setattr(attention.Documents, "mask", lambda self: built.append(self) or 1 / 0)
    flexed = []
    real_flex = attention.flex
    monkeypatch.setattr(attention, "flex", lambda *a, **kw: flexed.append("flex") or real_flex(*a, **kw))
    with torch.no_grad():
        loss = model(rows, labels=rows, **fields)
        logits = model(rows, **fields)
    assert built == [] and flexed == ["flex"] * 2 * model.config.num_hidden_layers
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)


def test_sdpa_gets_grouped_kv_heads_only_where_its_kernel_maps_them():
    """Grouped-query K/V go to SDPA as they are where its kernel maps them (flash: CUDA's in
    fp16/bf16 without a mask, the CPU's); CUDA's memory-efficient kernel, fp32's (`32-true`),
    does not, and SDPA would fall to the math kernel's fp32 T x T scores: K/V are copied to the
    query heads for it. Fake CUDA tensors: no GPU needed to ask which."""
    with FakeTensorMode():
        cuda = {
            dtype: torch.empty(1, 4, 8, 16, device="cuda", dtype=dtype)
            for dtype in (torch.float32, torch.bfloat16)
        }
        assert not attention.sdpa_maps_kv_heads(cuda[torch.float32], None)
        assert attention.sdpa_maps_kv_heads(cuda[torch.bfloat16], None)
        assert not attention.sdpa_maps_kv_heads(
            cuda[torch.bfloat16], torch.ones(8, 8, dtype=torch.bool, device="cuda")
        )
    assert attention.sdpa_maps_kv_heads(torch.empty(1, 4, 8, 16), torch.ones(8, 8, dtype=torch.bool))
