"""What the held-out split is worth in bits per byte, and what a compressor does on it.

Nats per token depend on the tokenizer; bits per byte of the text do not, so the validation loss
is reported as both (``val/bits_per_byte``, from the split's bytes per token) and set next to
``gzip -9`` and ``xz -9`` on the very same text: a language model that cannot beat gzip has not
learned much yet.
"""

from __future__ import annotations

import gzip
import lzma
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class HeldOut:
    n_bytes: int
    n_tokens: int
    gzip_bpb: float
    xz_bpb: float

    @property
    def bytes_per_token(self) -> float:
        return self.n_bytes / self.n_tokens

    def bits_per_byte(self, nats_per_token: float) -> float:
        return nats_per_token / math.log(2) / self.bytes_per_token

    def summary(self) -> str:
        return (
            f"held-out split: {self.n_bytes:,} bytes, {self.n_tokens:,} tokens ({self.bytes_per_token:.2f} bytes/token); "
            f"gzip -9 {self.gzip_bpb:.3f} bits/byte, xz -9 {self.xz_bpb:.3f} bits/byte"
        )


def held_out(batches: Iterable[dict[str, Any]], tokenizer: Any) -> HeldOut | None:
    """Measure the text of the validation batches (their ``input_ids``, decoded); None if empty."""
    texts, n_tokens = [], 0
    for batch in batches:
        for row in batch["input_ids"].tolist():
            texts.append(tokenizer.decode(row))
            n_tokens += len(row)
    data = "".join(texts).encode("utf-8")
    if not data:
        return None
    bpb = lambda packed: 8 * len(packed) / len(data)  # noqa: E731
    return HeldOut(len(data), n_tokens, bpb(gzip.compress(data, 9)), bpb(lzma.compress(data, preset=9)))
