"""Each tensor-parallel layer matches its dense twin, forward and backward (gloo, CPU, fp32)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist import run_distributed
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from nanolight.parallel.launcher import join_fake_world
from nanolight.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    comm,
    gather_full,
    take_shard,
    vocab_parallel_cross_entropy,
)
from nanolight.parallel.tensor_parallel.cross_entropy import VocabParallelCrossEntropyLoss

B, T, H, OUT, V = 2, 8, 16, 24, 32  # every size divisible by tp in {2, 4}
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{what}: {m}")


def _seq(x: torch.Tensor, rank: int, size: int, sp: bool) -> torch.Tensor:
    """This rank's share when sequence parallel (the r-th contiguous 1/size of the B*T tokens, in
    memory order, shaped (B, T/size, ...)), else the full tensor."""
    return x.reshape(B * T, -1).chunk(size)[rank].reshape(B, T // size, -1) if sp else x


def _check_column(rank: int, size: int, sp: bool, gather_output: bool) -> None:
    group = dist.group.WORLD
    dense = nn.Linear(H, OUT, bias=False)
    x = torch.randn(B, T, H, requires_grad=True)
    gy = torch.randn(B, T, OUT)
    dense(x).backward(gy)  # reference: y = x W^T over everything

    layer = ColumnParallelLinear(H, OUT, group, gather_output=gather_output, sequence_parallel=sp)
    layer.weight.data.copy_(dense.weight.detach().chunk(size, 0)[rank])
    x_local = _seq(x.detach(), rank, size, sp).requires_grad_()
    y = layer(x_local)
    expected_y = dense(x).detach()
    if gather_output:
        _close(y, expected_y, "column output (gathered)")
        y.backward(gy)
    else:
        _close(y, expected_y.chunk(size, -1)[rank], "column output shard")
        y.backward(gy.chunk(size, -1)[rank])
    _close(x_local.grad, _seq(x.grad, rank, size, sp), "column input grad")
    _close(layer.weight.grad, dense.weight.grad.chunk(size, 0)[rank], "column weight grad")


def _check_column_chunks(rank: int, size: int, sp: bool) -> None:
    """chunks=2 (the MLP's [gate | up]): rank k holds [gate_k | up_k], and its output is its slice
    of each half of the dense output; take_shard / gather_full follow the same rule."""
    group = dist.group.WORLD
    dense = nn.Linear(H, OUT, bias=False)
    x = torch.randn(B, T, H, requires_grad=True)
    gy = torch.randn(B, T, OUT)
    dense(x).backward(gy)

    def mine(t: torch.Tensor, dim: int) -> torch.Tensor:  # [first half's slice | second half's slice]
        first, second = t.chunk(2, dim)
        return torch.cat((first.chunk(size, dim)[rank], second.chunk(size, dim)[rank]), dim)

    layer = ColumnParallelLinear(H, OUT, group, chunks=2, sequence_parallel=sp)
    local = mine(dense.weight.detach(), 0)
    assert torch.equal(take_shard(dense.weight.detach(), 0, group, chunks=2), local)
    assert torch.equal(gather_full(local, 0, group, chunks=2), dense.weight.detach())
    layer.weight.data.copy_(local)
    x_local = _seq(x.detach(), rank, size, sp).requires_grad_()
    y = layer(x_local)
    _close(y, mine(dense(x).detach(), -1), "chunked column output shard")
    y.backward(mine(gy, -1))
    _close(x_local.grad, _seq(x.grad, rank, size, sp), "chunked column input grad")
    _close(layer.weight.grad, mine(dense.weight.grad, 0), "chunked column weight grad")


def _check_row(rank: int, size: int, sp: bool, input_is_parallel: bool) -> None:
    group = dist.group.WORLD
    dense = nn.Linear(OUT, H, bias=False)
    x = torch.randn(B, T, OUT, requires_grad=True)
    gy = torch.randn(B, T, H)
    y_ref = dense(x)
    y_ref.backward(gy)

    layer = RowParallelLinear(OUT, H, group, input_is_parallel=input_is_parallel, sequence_parallel=sp)
    layer.weight.data.copy_(dense.weight.detach().chunk(size, 1)[rank])
    x_local = (x.detach().chunk(size, -1)[rank] if input_is_parallel else x.detach()).requires_grad_()
    y = layer(x_local)
    _close(y, _seq(y_ref.detach(), rank, size, sp), "row output")
    y.backward(_seq(gy, rank, size, sp))
    expected_gx = x.grad.chunk(size, -1)[rank] if input_is_parallel else x.grad
    _close(x_local.grad, expected_gx, "row input grad")
    _close(layer.weight.grad, dense.weight.grad.chunk(size, 1)[rank], "row weight grad")


def _check_embedding(rank: int, size: int, sp: bool) -> None:
    group = dist.group.WORLD
    dense = nn.Embedding(V, H)
    ids = torch.randint(0, V, (B, T))
    gy = torch.randn(B, T, H)
    y_ref = dense(ids)
    y_ref.backward(gy)

    layer = VocabParallelEmbedding(V, H, group, sequence_parallel=sp)
    layer.weight.data.copy_(dense.weight.detach().chunk(size, 0)[rank])
    y = layer(ids)
    _close(y, _seq(y_ref.detach(), rank, size, sp), "embedding output")
    y.backward(_seq(gy, rank, size, sp))
    _close(layer.weight.grad, dense.weight.grad.chunk(size, 0)[rank], "embedding weight grad")


def _check_cross_entropy(rank: int, size: int) -> None:
    group = dist.group.WORLD
    logits = (5 * torch.randn(B, T, V)).requires_grad_()
    target = torch.randint(0, V, (B, T))
    target[0, :3] = -100  # ignored tokens do not count in the mean
    loss_ref = F.cross_entropy(logits.view(-1, V), target.view(-1), ignore_index=-100)
    loss_ref.backward()

    local = logits.detach().chunk(size, -1)[rank].requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, group)
    _close(loss, loss_ref.detach(), "cross-entropy loss")
    (2.0 * loss).backward()  # a non-unit upstream gradient must scale the result
    _close(local.grad, 2.0 * logits.grad.chunk(size, -1)[rank], "cross-entropy logits grad")


def _check_head_loss(rank: int, size: int, sp: bool) -> None:
    """The column-parallel head and the vocab-parallel loss in one chunked pass (`head_loss`, what
    the model's training loss calls) against the dense head and F.cross_entropy: loss, input and
    weight gradients, chunks of 5 tokens (the last one short) and 3 of them."""
    group = dist.group.WORLD
    dense = nn.Linear(H, V, bias=False)
    x = torch.randn(B, T, H, requires_grad=True)
    target = torch.randint(0, V, (B, T))
    target[0, :3] = -100
    loss_ref = F.cross_entropy(dense(x).view(-1, V), target.view(-1), ignore_index=-100, reduction="sum")
    (2.0 * loss_ref).backward()
    head = ColumnParallelLinear(H, V, group, sequence_parallel=sp)
    head.weight.data.copy_(dense.weight.detach().chunk(size, 0)[rank])
    local_x = _seq(x.detach(), rank, size, sp).requires_grad_()
    for rows in (5, 3):
        local_x.grad = head.weight.grad = None
        loss = VocabParallelCrossEntropyLoss(group).head_loss(head, local_x, target, "sum", rows=rows)
        _close(loss, loss_ref.detach(), "head loss")
        (2.0 * loss).backward()
        _close(local_x.grad, _seq(x.grad, rank, size, sp), "head loss input grad")
        _close(head.weight.grad, dense.weight.grad.chunk(size, 0)[rank], "head loss weight grad")


def _all_layers(rank: int, size: int, sp: bool) -> bool:
    torch.manual_seed(1234)  # identical dense weights and inputs on every rank
    _check_column(rank, size, sp, gather_output=False)
    _check_column_chunks(rank, size, sp)
    _check_row(rank, size, sp, input_is_parallel=True)
    _check_embedding(rank, size, sp)
    _check_head_loss(rank, size, sp)
    if not sp:  # the exit/entry variants are not used inside a sequence-parallel region
        _check_column(rank, size, sp, gather_output=True)
        _check_row(rank, size, sp, input_is_parallel=False)
        _check_cross_entropy(rank, size)
    return True


@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_layers_match_dense(tp: int, sp: bool) -> None:
    assert run_distributed(_all_layers, tp, sp) == [True] * tp


def test_cross_entropy_single_rank_matches_dense() -> None:
    """tp=1 degenerates to F.cross_entropy (run in-process on a world of one)."""
    assert run_distributed(_check_cross_entropy_world_one, 1) == [True]


def _check_cross_entropy_world_one(rank: int, size: int) -> bool:
    torch.manual_seed(0)
    _check_cross_entropy(rank, size)
    return True


class _Copies(TorchDispatchMode):
    """Bytes written by copying operators (a clone, a copy into a buffer, `contiguous`'s clone)."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if func._overloadpacket in (torch.ops.aten.clone, torch.ops.aten.copy_, torch.ops.aten._to_copy):
            self.nbytes += out.numel() * out.element_size()
        return out


def _sp_region_copies(rows: int, seq: int) -> tuple[int, bool]:
    """Bytes copied by a sequence-parallel gather and reduce-scatter, forward and backward, of
    (rows, seq) tokens on rank 0 of 2; and whether every output is contiguous (else its consumer
    copies it)."""
    group = dist.group.WORLD
    x = torch.randn(rows, seq // 2, H, requires_grad=True)
    with _Copies() as copies:
        full = comm.gather_from_sp(x, group)
        part = comm.reduce_scatter_to_sp(full * 2, group)
        part.backward(torch.ones_like(part))
    return copies.nbytes, all(t.is_contiguous() for t in (full, part, x.grad))


def test_sequence_parallel_bytes_depend_on_tokens_not_rows() -> None:
    """The same 64 tokens as one row or as four: a (B, T, H) shard of each row's T/tp positions
    had the collectives copy the whole tensor to and from (T, B, H) once B > 1; token chunks of
    the flattened rows copy nothing, and hand on contiguous tensors."""
    join_fake_world(0, 2)  # collectives return at once: the copies around them are what is counted
    try:
        assert _sp_region_copies(1, 64) == (0, True)
        assert _sp_region_copies(4, 16) == (0, True)
    finally:
        dist.destroy_process_group()
