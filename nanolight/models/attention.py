"""Causal attention kernels behind one call: flash-attn, PyTorch SDPA, or the textbook formula.

`attend(q, k, v, implementation)` takes (B, heads, T, head_dim) queries and (B, kv_heads, T,
head_dim) keys/values (grouped-query attention: each kv head serves ``heads // kv_heads``
consecutive query heads) and returns (B, heads, T, head_dim).

The model's attention layers call an `AttentionBackend` object, not a name: by default
`KernelAttention`, the kernel named by `LlamaConfig.attn_implementation` (its availability checked
when the model is built). A strategy may replace it on the built model
(`LlamaForCausalLM.set_attention_backend`) -- e.g. ring attention over a context-parallel group --
so that `models/` never imports parallel code.

Packed rows with `Documents`: a token attends only to earlier tokens of its own document, so
packing changes no document's result. Three kernels, chosen once per forward (`document_kernel`):
flash-attn's variable-length kernel (one sequence per document, offsets `cu_seqlens`: made by the
data where the batch is built, `varlen_offsets`, so a forward reads nothing back from the device)
with flash_attention_2; on a GPU with SDPA, FlexAttention with a block mask built from the document
starts (O(T) memory: no T x T mask, fully masked tiles skipped); else (CPU, eager) a dense
block-diagonal causal mask, the reference the others are tested against.

flash-attn takes only fp16/bf16 and one dtype for q, k and v: the model hands it q, k, v in the
projections' dtype (RoPE keeps its input's dtype), and under fp32 (`32-true`) the kernel runs in
bf16 and its result is cast back (with a one-time warning): flash-attn has no fp32 kernel.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

_SDPA_HAS_GQA = torch.__version__ >= "2.5"  # `enable_gqa` argument of scaled_dot_product_attention
FLASH_DTYPES = (torch.float16, torch.bfloat16)  # the only dtypes flash-attn's kernels take
FLEX_BLOCK = 128  # FlexAttention's default tile: the block mask's granularity


def flash_attn_available() -> bool:
    """True when the flash-attn package is importable and a CUDA GPU is present."""
    return importlib.util.find_spec("flash_attn") is not None and torch.cuda.is_available()


def check_attn_implementation(name: str) -> None:
    """Fail at build time, not at the first forward on 512 GPUs."""
    if name == "flash_attention_2" and not flash_attn_available():
        raise RuntimeError(
            "attn_implementation='flash_attention_2' needs the flash-attn package and a CUDA GPU "
            f"(flash-attn installed: {importlib.util.find_spec('flash_attn') is not None}, "
            f"CUDA available: {torch.cuda.is_available()}); install it with `pip install nanolight[flash]` "
            "on a GPU machine or use attn_implementation='sdpa'"
        )


def fused_document_kernels(device: torch.device) -> bool:
    """True where document masking runs an O(T)-memory kernel instead of the dense mask: CUDA.
    On CPU FlexAttention has no backward (torch 2.13), so the dense mask is the CPU path."""
    return device.type == "cuda"


def document_kernel(implementation: str, device: torch.device) -> str:
    """Which kernel keeps packed documents apart: "varlen" (flash-attn), "flex" (FlexAttention's
    block mask, SDPA on a GPU) or "dense" (a (B, 1, T, T) mask: CPU, and eager everywhere)."""
    if implementation == "flash_attention_2":
        return "varlen"
    if implementation == "sdpa" and fused_document_kernels(device):
        return "flex"
    return "dense"


def varlen_offsets(ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """flash-attn's (cu_seqlens, max_seqlen) for packed rows' document ids (B, T): every document of
    every row is its own sequence of the flattened (B * T) tokens; cu_seqlens int32 on the ids'
    device (where each starts, then B * T), max_seqlen a Python int (the kernel sizes its grid by
    it). Both depend on the ids' values, so this reads them: the data calls it on the host, where
    the batch is built (`data/loader.py`), and the batch carries them to the device."""
    B, T = ids.shape
    first = torch.ones_like(ids, dtype=torch.bool)  # a row start is a document start
    first[:, 1:] = ids[:, 1:] != ids[:, :-1]
    starts = first.reshape(-1).nonzero().squeeze(-1)
    cu = torch.cat([starts, torch.tensor([B * T], device=ids.device)]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


class Documents:
    """Which document each token of packed rows belongs to: `ids` (B, T), equal within a document
    (documents are contiguous runs), and, when the data made them, flash-attn's offsets
    (`varlen_offsets`). What the chosen kernel reads (`kernel`: see `document_kernel`) is built
    once per forward and shared by every layer; `prepare` builds it before the layers run, so a
    (compiled, recomputed) layer only reads it."""

    def __init__(
        self, ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None
    ) -> None:
        self.ids = ids
        self.kernel: str | None = None
        self._mask: torch.Tensor | None = None
        self._varlen = None if cu_seqlens is None else (cu_seqlens, max_seqlen)
        self._block_mask: BlockMask | None = None

    def prepare(self, implementation: str) -> Documents:
        """Choose the kernel for this implementation and device, build what it reads; returns self."""
        self.kernel = document_kernel(implementation, self.ids.device)
        {"varlen": self.varlen, "flex": self.block_mask, "dense": self.mask}[self.kernel]()
        return self

    def mask(self) -> torch.Tensor:
        """(B, 1, T, T) bool: query i may attend key j (same document, j <= i)."""
        if self._mask is None:
            T = self.ids.shape[1]
            same = self.ids[:, :, None] == self.ids[:, None, :]  # (B, T, T)
            causal = torch.ones(T, T, dtype=torch.bool, device=self.ids.device).tril()
            self._mask = (same & causal)[:, None]
        return self._mask

    def firsts(self) -> torch.Tensor:
        """(B, T) bool: the token begins a document (a row start is a document start)."""
        first = torch.ones_like(self.ids, dtype=torch.bool)
        first[:, 1:] = self.ids[:, 1:] != self.ids[:, :-1]
        return first

    def starts(self) -> torch.Tensor:
        """(B, T) int64: the index of the first token of each token's document."""
        B, T = self.ids.shape
        index = torch.arange(T, device=self.ids.device).expand(B, T)
        return torch.where(self.firsts(), index, 0).cummax(dim=1).values

    def varlen(self) -> tuple[torch.Tensor, int]:
        """flash-attn's (cu_seqlens, max_seqlen): the data's; for a caller that passed document ids
        alone, derived from them here (`varlen_offsets`, which reads the ids back: a host sync)."""
        if self._varlen is None:
            self._varlen = varlen_offsets(self.ids)
        return self._varlen

    def block_mask(self) -> BlockMask:
        """FlexAttention's mask: query q sees key k iff start[q] <= k <= q (`range_block_mask`)."""
        if self._block_mask is None:
            self._block_mask = range_block_mask(self.starts(), causal=True)
        return self._block_mask


def range_block_mask(first: torch.Tensor, causal: bool) -> BlockMask:
    """FlexAttention's mask for rows of queries that each see one range of keys: query q sees key
    k iff first[b, q] <= k, and k <= q when `causal`. `first` (B, Q) nondecreasing in q (packed
    documents: the first key of each query's document; Q means none), over as many keys as
    queries. Built at tile level -- (B, 1, Q/128, Q/128) -- never as a Q x Q tensor: a tile is
    skipped when no query of it sees a key of it, full (no mask evaluated) when every query sees
    every key."""
    B, T = first.shape
    n = -(-T // FLEX_BLOCK)
    first = F.pad(first, (0, n * FLEX_BLOCK - T), value=T)  # padded rows/columns are never read back
    tile = torch.arange(n, device=first.device)
    lo, hi = tile * FLEX_BLOCK, ((tile + 1) * FLEX_BLOCK).clamp(max=T) - 1  # each tile's tokens
    q_tile, kv_tile = tile[:, None], tile[None, :]
    # (B, n, n): some query of the tile sees some key of the tile / every query every key
    some = first[:, lo, None] <= hi[None, None, :]
    full = first[:, hi, None] <= lo[None, None, :]
    if causal:
        some, full = some & (kv_tile <= q_tile), full & (kv_tile < q_tile)
    partial = some & ~full

    def ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # per query tile: how many key tiles, and their indices first (stable: ascending)
        count = tiles.sum(-1, dtype=torch.int32)[:, None]  # (B, 1, n)
        order = tiles.to(torch.int32).argsort(dim=-1, descending=True, stable=True)
        return count, order.to(torch.int32)[:, None]  # (B, 1, n, n)

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        seen = kv >= first[b, q]
        return seen & (kv <= q) if causal else seen

    return BlockMask.from_kv_blocks(
        *ordered(partial), *ordered(full), BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod, seq_lengths=(T, T)
    )


def _flash_dtype(q: torch.Tensor) -> torch.dtype:
    """The one dtype flash-attn gets: autocast's (what the projections produced), else the
    tensors' own when half, else bf16 (fp32: flash-attn has no fp32 kernel)."""
    device = q.device.type
    if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) in FLASH_DTYPES:
        return torch.get_autocast_dtype(device)
    if q.dtype in FLASH_DTYPES:
        return q.dtype
    warnings.warn(
        "attn_implementation='flash_attention_2' under fp32: flash-attn has no fp32 kernel, so "
        "attention runs in bf16 (its result cast back to fp32); use 'sdpa' for fp32 attention",
        stacklevel=3,
    )
    return torch.bfloat16


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents | None) -> torch.Tensor:
    import flash_attn  # optional, checked at build time

    dtype = _flash_dtype(q)
    back = q.dtype if not torch.is_autocast_enabled(q.device.type) else dtype  # 32-true: fp32 out
    # (B, T, heads, head_dim), one dtype; GQA built in
    q, k, v = (t.transpose(1, 2).to(dtype) for t in (q, k, v))
    if documents is None:
        return flash_attn.flash_attn_func(q, k, v, causal=True).transpose(1, 2).to(back)
    B, T = q.shape[:2]
    cu, longest = documents.varlen()
    flat = [t.reshape(B * T, *t.shape[2:]) for t in (q, k, v)]
    y = flash_attn.flash_attn_varlen_func(
        *flat, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest, causal=True
    )
    return y.reshape(B, T, *y.shape[1:]).transpose(1, 2).to(back)


@functools.cache
def _compiled_flex():  # noqa: ANN202 (a compiled callable)
    """flex_attention compiled once per process: uncompiled it materialises the scores."""
    return torch.compile(flex_attention, dynamic=False)


def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask, **options: Any) -> Any:
    """FlexAttention under `block_mask`, grouped-query K/V as they are (`options`: flex_attention's
    own, e.g. ``scale``, ``return_lse``); compiled on a GPU, eager on CPU (forward-only there:
    torch 2.13 has no CPU backward for it)."""
    fn = _compiled_flex() if q.device.type == "cuda" else flex_attention
    return fn(q, k, v, block_mask=block_mask, enable_gqa=q.size(1) != k.size(1), **options)


def sdpa_maps_kv_heads(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether the kernel SDPA picks for these queries maps grouped-query K/V heads itself. The
    flash kernels do (CUDA's, for fp16/bf16 without a mask; the CPU's); CUDA's memory-efficient
    kernel, which fp32 (`32-true`) and masks get, does not, and SDPA would fall to its math kernel
    (fp32 (B, heads, T, T) scores): for it K/V are copied to the query heads (O(T) memory)."""
    return q.device.type != "cuda" or (q.dtype in FLASH_DTYPES and mask is None)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, implementation: str, documents: Documents | None = None
) -> torch.Tensor:
    if implementation == "flash_attention_2":
        return _flash(q, k, v, documents)
    if documents is not None and documents.kernel is None:
        documents.prepare(implementation)
    if documents is not None and documents.kernel == "flex":
        return flex(q, k, v, documents.block_mask())
    mask = documents.mask() if documents is not None else None
    r = q.size(1) // k.size(1)
    if implementation == "sdpa" and _SDPA_HAS_GQA and sdpa_maps_kv_heads(q, mask):
        # sdpa maps query head h to kv head h // r itself, without materialising copies of k, v.
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=r > 1
        )
    # Each kv head serves the r consecutive query heads of its group.
    k = k.repeat_interleave(r, dim=1)  # (B, heads, T, head_dim)
    v = v.repeat_interleave(r, dim=1)
    if implementation == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
    # eager: the textbook formula, kept as the reference the fused kernels are tested against.
    T = q.size(2)
    att = (q @ k.transpose(-2, -1)) * (q.size(-1) ** -0.5)  # (B, heads, T, T)
    allowed = mask if mask is not None else torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    att = att.masked_fill(~allowed, float("-inf"))
    att = F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype)
    return att @ v


@runtime_checkable
class AttentionBackend(Protocol):
    """What every attention layer of a model calls. `prepare` runs once per forward, before the
    layers (so a compiled or recomputed layer only reads what it built); `attend` maps
    (B, heads, T, head_dim) queries and (B, kv_heads, T, head_dim) keys/values to
    (B, heads, T, head_dim), causal, keeping packed `documents` apart. `name` is for messages."""

    name: str

    def prepare(self, documents: Documents) -> Documents: ...

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents | None
    ) -> torch.Tensor: ...


class KernelAttention:
    """The default backend: one local kernel chosen by name ("eager", "sdpa",
    "flash_attention_2"); fails at construction, when the model is built, if it cannot run."""

    def __init__(self, implementation: str) -> None:
        check_attn_implementation(implementation)
        self.name = implementation

    def prepare(self, documents: Documents) -> Documents:
        return documents.prepare(self.name)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents | None = None
    ) -> torch.Tensor:
        return attend(q, k, v, self.name, documents)

    def __repr__(self) -> str:
        return f"KernelAttention({self.name!r})"
