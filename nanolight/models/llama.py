"""Llama / SmolLM causal language model in plain PyTorch.

Read top to bottom like nanoGPT's model.py: RMSNorm, attention with one fused qkv projection,
a SwiGLU MLP with one fused gate_up projection, the decoder block, the model. There is no
parallel code here. Tensor parallelism is applied from outside using `LlamaForCausalLM.tp_plan`
(data: module name -> "column" | "row" | "vocab", or ("column", n): n blocks each split); to make
that possible the fused weights are laid out so that a tp shard is a whole set of heads / MLP
units (see `CausalSelfAttention` and `SwiGLU`), and every module derives its local head or unit
count from its weight's shape, so a tp-sharded module runs this same forward.

Module names are stable (`model.layers.{i}.self_attn.qkv_proj`, ...): the TP plan, the pipeline
split and checkpoints all key on them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from nanolight.models.attention import AttentionBackend, Documents, KernelAttention, flash_attn_available
from nanolight.models.fused_loss import linear_cross_entropy
from nanolight.models.llama_config import LlamaConfig, stage_costs
from nanolight.models.llama_rope import rope_cos_sin, rope_inv_freq, rope_qkv

__all__ = ["LlamaConfig", "LlamaForCausalLM", "causal_lm_loss", "flash_attn_available", "shift_labels"]

IGNORE_INDEX = -100


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy over tokens whose label is not -100 (their mean, or with ``reduction="sum"``
    their sum). logits (B, T, V), labels (B, T).

    The inputs are already aligned (logits at t predict labels at t: the caller shifted the
    labels and put -100 where nothing is predicted). Computed in fp32 as HF does.
    The tensor-parallel strategy swaps `LlamaForCausalLM.loss_fn` for a vocab-parallel version
    with this same signature (and a `head_loss(head, hidden, labels, reduction)` that the model's
    loss calls instead, running the sharded head and the loss in token chunks).
    """
    logits, labels = logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1)
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction=reduction)


def shift_labels(labels: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token targets (B, T) from labels aligned with the inputs (B, T): target t is label t+1,
    -100 at the last position (nothing follows it) and, with `document_ids`, at a document's last
    token (the next document's first token is not its continuation).

    Done where the sequence is still whole -- the data (`data/loader.py`), or the model's
    HF-style ``labels=`` path -- never on a piece of a sequence: a rank holding the middle of a
    sequence (context parallelism) cannot see the token after its last one.
    """
    # shift the labels left rather than slicing the logits, which would copy the largest activation
    shifted = F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)
    if document_ids is not None:
        crossing = F.pad(document_ids[..., 1:] != document_ids[..., :-1], (0, 1), value=False)
        shifted = shifted.masked_fill(crossing, IGNORE_INDEX)
    return shifted


def _rms_plain(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        x32 = x.float()
        r = torch.rsqrt(x32.square().mean(-1, keepdim=True).add_(eps))  # (..., 1) fp32
        ctx.save_for_backward(x, weight, r)
        y = (x32 * r).to(x.dtype)  # a new tensor: the weight is applied in place (x * weight order)
        return y.mul_(weight) if torch.result_type(y, weight) == y.dtype else weight * y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, weight, r = ctx.saved_tensors
        C = x.shape[-1]
        x32, g32, w32 = x.float(), grad.float(), weight.float()
        gx = (g32 * x32).reshape(-1, C)  # the one product both row sums read
        d_weight = None
        with torch.autocast(x.device.type, enabled=False):  # the sums stay fp32 under autocast
            if ctx.needs_input_grad[1]:  # sum_rows(grad * x * r): a (1, N) @ (N, C) product
                d_weight = (r.reshape(1, -1) @ gx).reshape(C).to(weight.dtype)
            # mean(g * n) = r * (grad * x) @ weight / C: d_x = r * g - x * r^3 * ((grad * x) @ weight) / C
            coef = (gx @ w32).reshape(r.shape).mul_(r.pow(3)).div_(C)  # (..., 1)
        d_x = torch.mul(g32, w32).mul_(r).addcmul_(x32, coef, value=-1)
        return d_x.to(x.dtype), d_weight, None


class RMSNorm(nn.Module):
    """RMSNorm: x / rms(x) * weight, normalised in fp32 (bf16 squares lose too much precision).

    In eager mode the normalisation runs as one autograd Function with its gradient written out
    (dx = r * (g - n * mean(g * n)), n = x * r, g = dy * weight, r = 1 / rms(x)), both row sums
    (d weight's and mean(g * n)) read off one product dy * x as matrix-vector products, every
    other op in place: six passes over the activation where autograd's walk through pow, mean,
    rsqrt and two muls takes about twelve (measured on CPU, fp32, (4, 256, 320), one thread:
    1.7 -> 1.1 ms forward + backward). Under `torch.compile` the plain formula is used, which
    inductor fuses itself."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling():
            return _rms_plain(x, self.weight, self.eps)
        return _RMSNorm.apply(x, self.weight, self.eps)


class CausalSelfAttention(nn.Module):
    """Grouped-query attention (MHA when n_kv == n_heads, MQA when n_kv == 1).

    qkv_proj rows are grouped per kv head g: [q_{g*r}, ..., q_{g*r+r-1}, k_g, v_g], each head_dim
    rows, r = n_heads / n_kv. So rows [a, b) of whole groups hold exactly the query heads that use
    those kv heads, and a tensor-parallel rank's contiguous shard is self-contained.
    """

    def __init__(self, config: LlamaConfig, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.q_per_kv = config.num_attention_heads // config.num_key_value_heads  # r
        # the attention computation itself (`models/attention.py`); the model shares one among its layers
        self.attention_backend = (
            backend if backend is not None else KernelAttention(config.attn_implementation)
        )
        n_q, n_kv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, n_kv * (self.q_per_kv + 2) * hd, bias=False)
        self.o_proj = nn.Linear(n_q * hd, config.hidden_size, bias=False)

    @property
    def attn_implementation(self) -> str:
        return self.attention_backend.name

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, documents: Documents | None = None
    ) -> torch.Tensor:
        B, T, _ = x.shape
        r, hd = self.q_per_kv, self.head_dim
        qkv = self.qkv_proj(x).view(B, T, -1, r + 2, hd)  # (B, T, n_kv_local, r + 2, head_dim)
        # q (B, T, n_heads_local, head_dim), k and v (B, T, n_kv_local, head_dim); backward writes
        # their gradients into one buffer shaped like qkv
        q, k, v = rope_qkv(qkv, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # heads first
        y = self.attention_backend.attend(q, k, v, documents)  # (B, n_heads_local, T, head_dim)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, n_heads_local * head_dim)
        return self.o_proj(y)


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up of the projection's output [gate | up], with the gradient of gate and up
    written into one buffer shaped like that output: autograd would give two tensors and join
    them with a copy (of the MLP's widest activation, on every device)."""

    @staticmethod
    def forward(ctx: Any, gate_up: Tensor) -> Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate)
        ctx.save_for_backward(gate_up, act)  # what autograd keeps too: the input and silu(gate)
        return act * up

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        gate_up, act = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        d_gate_up = torch.empty_like(gate_up)
        d_gate, d_up = d_gate_up.chunk(2, dim=-1)
        torch.mul(grad, act, out=d_up)
        torch.mul(grad, up, out=d_gate)  # d silu(gate), then through silu in place
        torch.ops.aten.silu_backward.grad_input(d_gate, gate, grad_input=d_gate)
        return d_gate_up


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one matmul.

    gate_up_proj's rows are blocked, [gate_0 .. gate_{I-1} | up_0 .. up_{I-1}], so gate and up
    are unit-stride halves of its output on every device (vectorised elementwise kernels).
    Tensor parallelism splits each half (`tp_plan`'s ("column", 2)): shard k = [gate_k | up_k],
    matching units, and this same forward runs on it.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if torch.compiler.is_compiling():
            # inductor makes the fused kernels and the one gradient buffer from the plain expression
            # itself; `_SwiGLU` is what eager mode needs for the same (its out= writes are opaque
            # mutations to a compiler, functionalised into copies)
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(_SwiGLU.apply(gate_up))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: LlamaConfig, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = CausalSelfAttention(config, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, documents: Documents | None = None
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, documents)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embedding, decoder stack and final norm: token ids (B, T) -> hidden states (B, T, C)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.attention_backend: AttentionBackend = KernelAttention(config.attn_implementation)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, self.attention_backend) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
    ) -> torch.Tensor:
        """`hidden_states` replaces the embedding's output (a pipeline stage's input); a module a
        pipeline split removed (None) is skipped, so one forward serves every stage.
        `document_ids` (B, T) keep packed documents apart (attention stays inside a document);
        `cu_seqlens` / `max_seqlen`, their offsets for flash-attn (`attention.varlen_offsets`)."""
        x = self.embed_tokens(input_ids) if hidden_states is None else hidden_states  # (B, T, C)
        cos, sin = self.rotary_tables(input_ids.shape, position_ids, x)
        documents = None
        if document_ids is not None:  # built here, once, not inside a (compiled) layer
            documents = self.attention_backend.prepare(Documents(document_ids, cu_seqlens, max_seqlen))
        for layer in self.layers:
            x = layer(x, cos, sin, documents)
        return x if self.norm is None else self.norm(x)

    def rotary_tables(
        self, shape: torch.Size, position_ids: torch.Tensor | None, like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (B, T, head_dim) for `position_ids` ((T,) or (B, T)), or (1, T, head_dim) for
        positions 0..T-1 (shared by every row)."""
        B, T = shape
        if position_ids is None:
            position_ids = torch.arange(T, device=like.device)[None]
        elif position_ids.dim() == 1:
            position_ids = position_ids.expand(B, T)
        c = self.config
        inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling, device=like.device)
        return rope_cos_sin(position_ids, inv_freq, like.dtype)


class LlamaForCausalLM(nn.Module):
    """The causal LM: `model(input_ids)` -> logits (B, T, V); with labels -> mean token loss.

    Labels are aligned with input_ids (labels == input_ids for plain LM training); the model
    shifts them itself and ignores -100, as HF does. ``target_ids=`` are targets already shifted
    (`shift_labels`, done by the data where the sequence is whole): the path nanolight's recipe
    trains on. Its loss is the token sum divided by `loss_divisor` when a training step set one
    (the strategy: the step's mean valid targets per micro-batch, `parallel/loss_tokens.py`, so
    that the trainer's mean over micro-batches and dp ranks is the exact token mean of the global
    batch, gradients included), else by the number of valid targets (the plain mean).

    Initialisation (`init_weights`, run by the constructor unless built on the meta device):
    every Linear and the embedding ~ N(0, initializer_range), every RMSNorm weight = 1.
    Deterministic given the torch seed (or `generator`), parameters drawn one after another in
    `named_parameters()` order.
    """

    # Pipeline plan: which modules only the first / last stage runs, and the blocks split between
    # stages. Data only, like the tp plan: `nanolight/parallel/pipeline/split.py` applies it.
    pp_plan: dict = {
        "first": ("model.embed_tokens",),
        "layers": "model.layers",
        "last": ("model.norm", "lm_head"),
    }
    # Tensor-parallel plan: module-name pattern -> style. Data only; the strategy applies it.
    tp_plan: dict[str, str | tuple[str, int]] = {
        "model.embed_tokens": "vocab",
        "model.layers.*.self_attn.qkv_proj": "column",
        "model.layers.*.self_attn.o_proj": "row",
        "model.layers.*.mlp.gate_up_proj": ("column", 2),  # [gate | up]: each half split over tp
        "model.layers.*.mlp.down_proj": "row",
        "lm_head": "column",
    }
    # Set by the strategy for the duration of a training step (None: the plain mean).
    loss_divisor: torch.Tensor | None = None

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.loss_fn = causal_lm_loss
        device = torch.empty(0).device  # the caller's default device (honours `with torch.device(...)`)
        # Always build on meta, then materialise + init_weights unless the caller wants meta:
        # one init scheme, no wasted PyTorch default init, and a model built directly on a device
        # equals a meta build + to_empty + init_weights under the same seed.
        with torch.device("meta"):
            self.model = LlamaModel(config)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        if device.type != "meta":
            self.to_empty(device=device)
            self.init_weights()

    def tie_weights(self) -> None:
        """Make lm_head.weight the same Parameter as the embedding when the config ties them (and
        this pipeline stage holds both)."""
        if (
            self.config.tie_word_embeddings
            and self.lm_head is not None
            and self.model.embed_tokens is not None
        ):
            self.lm_head.weight = self.model.embed_tokens.weight

    def to_empty(self, *, device: torch.device | str | None, recurse: bool = True) -> LlamaForCausalLM:
        """Materialise a meta-device model. Re-ties: moving off meta replaces Parameter objects."""
        materialise_(self, torch.device(device) if device is not None else torch.empty(0).device)
        self.tie_weights()
        return self

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        target_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
    ) -> torch.Tensor:
        """Without a head (a pipeline stage before the last) returns the hidden states (B, T, C).
        With `document_ids` packed documents do not see each other, and (``labels=``) the last
        token of a document is not asked to predict the next document's first; `cu_seqlens` and
        `max_seqlen` are their flash-attn offsets, made with the batch (`data.document_fields`).
        `labels` (aligned with input_ids, HF's meaning) or `target_ids` (already shifted): see the
        class docstring."""
        if labels is not None and target_ids is not None:
            raise ValueError(
                "pass labels= (aligned with input_ids, shifted by the model) or target_ids= (already "
                "shifted), not both"
            )
        h = self.model(
            input_ids, position_ids, hidden_states, document_ids, cu_seqlens, max_seqlen
        )  # (B, T, C)
        if self.lm_head is None:
            return h
        if labels is None and target_ids is None:
            return self.lm_head(h)  # (B, T, V)
        divisor = self.loss_divisor if target_ids is not None else None
        if target_ids is None:
            target_ids = shift_labels(labels, document_ids)  # (B, T)
        if self.loss_fn is causal_lm_loss and type(self.lm_head) is nn.Linear:
            # the plain head and loss: fused over token chunks, the logits never held (fused_loss.py)
            loss_sum = linear_cross_entropy(h, self.lm_head.weight, target_ids, reduction="sum")
        elif hasattr(self.loss_fn, "head_loss"):  # a loss that runs the head itself (tensor parallelism's)
            loss_sum = self.loss_fn.head_loss(self.lm_head, h, target_ids, reduction="sum")
        else:
            loss_sum = self.loss_fn(self.lm_head(h), target_ids, reduction="sum")
        if divisor is None:
            divisor = (target_ids != IGNORE_INDEX).sum()  # the plain mean (NaN with no valid target)
        return loss_sum / divisor

    def set_attention_backend(self, backend: AttentionBackend) -> None:
        """Make `backend` what every attention layer of this model (this pipeline stage's) calls,
        and what prepares packed documents, from the next forward on. How a strategy plugs in e.g.
        ring attention while `models/` imports nothing parallel; call it before compiling blocks."""
        if not isinstance(backend, AttentionBackend):
            raise TypeError(
                f"set_attention_backend needs an object with name, prepare(documents) and "
                f"attend(q, k, v, documents) (models/attention.py AttentionBackend), got {type(backend).__name__}"
            )
        for module in self.modules():
            if isinstance(module, (LlamaModel, CausalSelfAttention)):
                module.attention_backend = backend

    @property
    def attention_backend(self) -> AttentionBackend:
        return self.model.attention_backend

    # ------------------------------------------------------------------ initialisation
    def init_param(self, name: str, tensor: torch.Tensor, generator: torch.Generator | None = None) -> None:
        """Initialise one parameter in place, given its `named_parameters()` name.

        Works on any tensor of the parameter's FULL shape, which is how a tensor-parallel
        strategy gets topology-independent init: draw the full tensor here, keep its slice.
        Norm weights -> 1; everything else (linears, embedding) -> N(0, initializer_range).
        """
        with torch.no_grad():
            if name.endswith("norm.weight"):
                tensor.fill_(1.0)
            elif name.endswith("mlp.gate_up_proj.weight"):
                # drawn unit by unit (gate_j's row, then up_j's), stored [gate | up]: the stream's
                # order is the model's, not the storage's, so a seed gives the weights it always has
                drawn = torch.empty_like(tensor).view(-1, 2, tensor.shape[-1])
                drawn.normal_(0.0, self.config.initializer_range, generator=generator)
                tensor.view(2, -1, tensor.shape[-1]).copy_(drawn.transpose(0, 1))
            else:
                tensor.normal_(0.0, self.config.initializer_range, generator=generator)

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """(Re)initialise every parameter, in `named_parameters()` order (tied weights once)."""
        self.tie_weights()
        for name, param in self.named_parameters():
            self.init_param(name, param.data, generator)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def directory_config(self) -> dict:
        """The fields a model directory's ``config.json`` holds for this model: a checkpoint of
        any module holding it is then also a model directory (load_pretrained, HF export)."""
        return self.config.directory_fields()

    def pipeline_costs(self) -> tuple[float, float, float]:
        """(block, first-stage extra, last-stage extra) costs, for balancing pipeline stages."""
        return stage_costs(self.config)


def materialise_(module: nn.Module, device: torch.device) -> None:
    """``module.to_empty(device=device)``, written out: each meta parameter and buffer replaced by a
    new uninitialised one on `device`. ``to_empty`` swaps fake tensors (the dry run's) in place, which
    torch refuses while a weak reference to them is held (fake tensors keep one)."""
    for mod in module.modules():
        for name, param in list(mod.named_parameters(recurse=False)):
            setattr(mod, name, nn.Parameter(torch.empty_like(param, device=device), param.requires_grad))
        for name, buf in list(mod.named_buffers(recurse=False)):
            setattr(mod, name, torch.empty_like(buf, device=device))
