"""Document boundaries of packed rows, for attention that keeps packed documents apart.

A packed row concatenates documents, each ended by EOS. With `data.document_mask=true` every
batch also carries, per token,

    position_ids   0, 1, 2, ... restarting at 0 on the token after each EOS (and at the row start)
    document_ids   0 for the row's first (possibly partial) document, +1 after each EOS

so the model can build a block-diagonal causal mask (tokens attend only within their document
id) or flash-attn's varlen offsets, and rotary positions start afresh per document. Both are
computed from the row alone: nothing crosses a row, and the EOS belongs to the document it ends.

The next-token targets are made here too, while the row is whole (`make_batch`): a rank that
holds a piece of it (context parallelism) could not shift its own, and counting a step's valid
targets before its micro-batches run needs them (`parallel/loss_tokens.py`).
"""

from __future__ import annotations

import torch

from nanolight.models.llama import shift_labels


def document_fields(input_ids: torch.Tensor, eos_id: int) -> dict[str, torch.Tensor]:
    """{"position_ids", "document_ids"} (int64, shape of `input_ids` (B, T)) for packed rows."""
    is_eos = (input_ids == eos_id).to(torch.int64)
    # a document starts after each EOS: the count of EOS strictly before a token is its document
    document_ids = torch.cumsum(is_eos, dim=-1) - is_eos
    t = input_ids.shape[-1]
    arange = torch.arange(t, dtype=torch.int64).expand_as(input_ids)
    # position = index - index of the document's first token; first tokens are where the id changes
    starts = torch.zeros_like(document_ids, dtype=torch.bool)
    starts[..., 0] = True
    starts[..., 1:] = document_ids[..., 1:] != document_ids[..., :-1]
    first = torch.cummax(torch.where(starts, arange, torch.zeros_like(arange)), dim=-1).values
    return {"position_ids": arange - first, "document_ids": document_ids}


def make_batch(ids: torch.Tensor, document_eos: int | None) -> dict[str, torch.Tensor]:
    """The loaders' batch dict: input_ids and `target_ids` -- the next token, -100 at the row's last
    position and, with document fields, at each document's last token (`shift_labels`)."""
    if document_eos is None:
        return {"input_ids": ids, "target_ids": shift_labels(ids)}
    fields = document_fields(ids, document_eos)
    return {"input_ids": ids, "target_ids": shift_labels(ids, fields["document_ids"]), **fields}
