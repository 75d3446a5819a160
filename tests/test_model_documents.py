"""Document masking: a packed row with `document_ids` (and restarting `position_ids`) computes
exactly what its documents compute one by one -- logits and the mean token loss -- with SDPA,
eager and (a stand-in for) flash-attn's variable-length kernel, also under tensor parallelism."""

from __future__ import annotations

import traceback

import pytest
import torch
from _sync_count import SYNC_OPS, SYNC_PACKETS
from _tiny import run_distributed, tiny_config
from torch.utils._python_dispatch import TorchDispatchMode

from nanolight.data import document_fields
from nanolight.models import LlamaForCausalLM
from nanolight.strategies.parallel3d import Parallel3DStrategy

pytest_plugins = ["_flash_standin"]  # the flash_standin fixture

LENGTHS, EOS = (5, 7, 4), 3


def _packed() -> tuple[list[torch.Tensor], torch.Tensor]:
    """Three documents, each ended by EOS, and their packing into one row of 16 tokens."""
    g = torch.Generator().manual_seed(0)
    docs = [torch.cat([torch.randint(4, 128, (n - 1,), generator=g), torch.tensor([EOS])]) for n in LENGTHS]
    return docs, torch.cat(docs)[None]


def _one_by_one(model: LlamaForCausalLM, docs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits of every document, concatenated; mean loss over every document's predictions)."""
    logits = torch.cat([model(d[None])[0] for d in docs])
    total = sum(model(d[None], labels=d[None]) * (len(d) - 1) for d in docs)
    return logits, total / sum(len(d) - 1 for d in docs)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_packed_row_equals_its_documents_one_by_one(attn: str) -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(attn_implementation=attn)).eval()
    docs, row = _packed()
    fields = document_fields(row, EOS)
    assert fields["position_ids"].tolist() == [[*range(5), *range(7), *range(4)]]
    with torch.no_grad():
        ref_logits, ref_loss = _one_by_one(model, docs)
        logits = model(row, **fields)[0]
        loss = model(row, labels=row, **fields)
        unmasked = model(row, labels=row)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    assert abs(unmasked - ref_loss) > 1e-3  # without the mask the documents see each other


def test_flash_varlen_gets_one_sequence_per_document(flash_standin) -> None:  # noqa: ANN001
    """No GPU here: the stand-in flash_attn (the kernel's input checks, SDPA per sequence), in
    bf16 as the kernel requires, against SDPA's dense mask in bf16."""
    torch.manual_seed(0)
    sdpa = LlamaForCausalLM(tiny_config(attn_implementation="sdpa")).eval().bfloat16()
    flash = LlamaForCausalLM(tiny_config(attn_implementation="flash_attention_2")).eval().bfloat16()
    flash.load_state_dict(sdpa.state_dict())
    docs, row = _packed()
    rows = torch.cat([row, row.flip(1)])  # two rows: documents never span a row
    fields = document_fields(rows, EOS)
    with torch.no_grad():
        torch.testing.assert_close(flash(rows, **fields), sdpa(rows, **fields), rtol=2e-2, atol=2e-2)
    # the second row: EOS first, then 4, 7 and 4 tokens
    assert flash_standin.calls[0]["cu_seqlens"] == [0, 5, 12, 16, 17, 21, 28, 32]


class DeviceReads(TorchDispatchMode):
    """The ops that read a device tensor back to the host (`_sync_count`'s list: a sync on a GPU),
    outside the flash-attn stand-in (whose checks read the offsets: the real kernel's do not)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func in SYNC_OPS or func.overloadpacket in SYNC_PACKETS:
            if not any("_standins" in frame.filename for frame in traceback.extract_stack()):
                self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


def test_flash_varlen_step_reads_nothing_back_from_the_device(flash_standin) -> None:  # noqa: ANN001
    """The data makes the documents' varlen offsets where it builds the batch (`document_fields`:
    `cu_seqlens`, `max_seqlen`), so a training forward and backward under flash-attn's varlen
    kernel dispatch no host sync -- deriving them from the ids would (`nonzero`, the longest
    length as an int) in every forward."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(attn_implementation="flash_attention_2")).bfloat16()
    _, row = _packed()
    rows = torch.cat([row, row.flip(1)])
    fields = document_fields(rows, EOS)
    assert fields["cu_seqlens"].dtype == torch.int32 and type(fields["max_seqlen"]) is int
    reads = DeviceReads()
    with reads:
        model(rows, labels=rows, **fields).backward()
    assert reads.reads == []
    assert [c["cu_seqlens"] for c in flash_standin.calls] == [[0, 5, 12, 16, 17, 21, 28, 32]] * 2
    with reads:  # the count can fail: the same model given the document ids alone derives them
        model(rows, labels=rows, position_ids=fields["position_ids"], document_ids=fields["document_ids"])
    assert reads.reads


def _tp_worker(rank: int, world: int, sp: bool) -> float:
    torch.manual_seed(0)
    docs, row = _packed()
    model = LlamaForCausalLM(tiny_config())
    strategy = Parallel3DStrategy(tp=world, sequence_parallel=sp, init_seed=0)
    strategy.setup_environment()
    wrapper = torch.nn.Module()
    wrapper.model = model
    strategy.setup_module(wrapper)
    with torch.no_grad():
        return float(model(row, labels=row, **document_fields(row, EOS)))


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_tensor_parallel_packed_loss_equals_one_by_one(sp: bool) -> None:
    torch.manual_seed(0)
    reference = LlamaForCausalLM(tiny_config())
    reference.init_weights(torch.Generator().manual_seed(0))
    docs, _ = _packed()
    with torch.no_grad():
        _, ref_loss = _one_by_one(reference, docs)
    for loss in run_distributed(_tp_worker, 2, sp, timeout=120):
        assert loss == pytest.approx(float(ref_loss), rel=1e-5)
