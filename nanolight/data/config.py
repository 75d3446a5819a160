"""`DataConfig`: what text to train on, how to tokenize it, and where the token cache lives;
`BatchGeometry`: the shape of this rank's share of a step, which every loader takes.

The schemas live next to the data pipeline they configure (DESIGN.md) and validate themselves in
`__post_init__`, so a bad `data=` override fails in the parent process with a message that says
which key is wrong and how to fix it, before any rank tokenizes anything.
"""

from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass, fields
from typing import Any, Literal

from nanolight.errors import UsageError

EMBEDDED = "embedded"
"""The `path`/`tokenizer` value that selects the built-in, offline corpus and BPE tokenizer."""


class DataError(UsageError):
    """Data that cannot be trained on (a damaged file, a wrong index, a bad mixture). The message
    names the file or key and says how to fix it."""


class DataNotFound(DataError, FileNotFoundError):
    """A data path or tokenizer directory that is not there (a FileNotFoundError to callers too)."""


@dataclass
class MixtureSource:
    """One entry of `data.mixture`: a directory made by scripts/prepare_data.py and its weight."""

    path: str
    weight: float
    name: str | None = None

    @classmethod
    def from_value(cls, value: Any, key: str) -> MixtureSource:
        if isinstance(value, MixtureSource):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"{key}={value!r} must be a mapping like {{path: /data/fineweb, weight: 0.7}}")
        valid = [f.name for f in fields(cls)]
        for k in value:
            if k not in valid:
                close = difflib.get_close_matches(k, valid, n=1)
                hint = f" Did you mean `{close[0]}`?" if close else ""
                raise ValueError(f"unknown key `{key}.{k}`.{hint} Valid keys: {', '.join(valid)}")
        if not value.get("path"):
            raise ValueError(f"{key} has no `path`: name a directory made by scripts/prepare_data.py")
        weight = value.get("weight")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < math.inf:
            raise ValueError(
                f"{key}.weight={weight!r} must be a finite number > 0 (weights are relative: 0.7/0.2/0.1 and 7/2/1 "
                "are the same mixture); drop the entry to leave a source out"
            )
        return cls(path=str(value["path"]), weight=float(weight), name=value.get("name"))


@dataclass
class DataConfig:
    """Where the text comes from and how it becomes packed token blocks.

    path: `embedded` (the Python standard library source, no network), a local file, directory
        or glob of .jsonl/.json/.parquet/.txt files, or a Hugging Face hub dataset name.
    name / split / revision: hub dataset config name, split and revision (pin `revision` for a
        reproducible hub corpus).
    text_field: the column holding each document's text (.txt files: one document per file).
    streaming: read the corpus as a stream, tokenizing on the fly (no token cache), for corpora
        too large to tokenize up front.
    tokenizer: `embedded` (a byte-level BPE trained on the embedded corpus), a local tokenizer
        directory or a hub name such as `HuggingFaceTB/SmolLM-135M`.
    cache_dir: where the embedded corpus, embedded tokenizer and token shards are written once
        and reused (`~` is expanded). A config field, not an environment variable.
    val_fraction: share of packed blocks held out for validation (map-style data).
    val_blocks: exact number of held-out blocks instead of `val_fraction`; a stream has no known
        length, so this is the only way to get a validation split when `streaming` is on.
    embedded_max_mb: cap on the embedded corpus size (MB of source text).
    embedded_vocab_size: vocabulary of the embedded tokenizer (8192 matches `smollm-tiny`).
    tokenizer_train_mb: cap on the text used to train the embedded tokenizer, to keep that
        one-off step to seconds.
    num_proc: worker processes for `datasets.map` tokenization; None tokenizes in this process
        (the fast tokenizer already uses all cores for a batch).
    tokenize_batch_size: documents per tokenizer call.
    shuffle_buffer: streaming only: blocks per shuffle window (0 = stream order). A window is
        read, permuted by the seed and served; resuming re-reads at most one window.
    mixture: prepared directories with weights, e.g. `[{path: /d/fineweb, weight: 0.7},
        {path: /d/code, weight: 0.3}]`; every window of global batches holds each source in
        proportion to its weight (a fixed interleaving, not random draws). Replaces `path`.
    mixture_exhausted: a mixture source that runs out of samples is `repeat`ed (a new permutation,
        with a warning) or `stop`s the epoch (every source restarts in the next one).
    document_mask: also yield `position_ids` (restarting at 0 after every EOS) and `document_ids`
        (distinct per document within a row), so the model can keep packed documents apart.
    A `path` that is a directory made by scripts/prepare_data.py is read by memory map, and the
    run uses the tokenizer saved with it (`tokenizer` left at `embedded`) or checks that the one
    named in `tokenizer` is the same.
    """

    path: str = EMBEDDED
    name: str | None = None
    split: str = "train"
    revision: str | None = None
    text_field: str = "text"
    streaming: bool = False
    tokenizer: str = EMBEDDED
    cache_dir: str = "~/.cache/nanolight"
    val_fraction: float = 0.01
    val_blocks: int | None = None
    embedded_max_mb: float = 20.0
    embedded_vocab_size: int = 8192
    tokenizer_train_mb: float = 8.0
    num_proc: int | None = None
    tokenize_batch_size: int = 1000
    shuffle_buffer: int = 1024
    mixture: list[Any] | None = None
    mixture_exhausted: Literal["repeat", "stop"] = "repeat"
    document_mask: bool = False

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError(
                "data.path is empty: set it to `embedded`, a local file/glob or a hub dataset name"
            )
        if not self.text_field:
            raise ValueError("data.text_field is empty: name the column that holds the document text")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(
                f"data.val_fraction={self.val_fraction} must be in [0, 1); use 0 for no validation"
            )
        if self.val_blocks is not None and self.val_blocks < 0:
            raise ValueError(f"data.val_blocks={self.val_blocks} must be >= 0 or null (use val_fraction)")
        if self.embedded_max_mb <= 0 or self.tokenizer_train_mb <= 0:
            raise ValueError("data.embedded_max_mb and data.tokenizer_train_mb must be > 0 (MB of text)")
        if self.embedded_vocab_size < 512:
            raise ValueError(
                f"data.embedded_vocab_size={self.embedded_vocab_size} is too small for byte-level BPE "
                "(256 byte tokens + merges); use >= 512, e.g. 8192"
            )
        if self.num_proc is not None and self.num_proc < 1:
            raise ValueError(f"data.num_proc={self.num_proc} must be >= 1 or null (tokenize in-process)")
        if self.tokenize_batch_size < 1 or self.shuffle_buffer < 0:
            raise ValueError("data.tokenize_batch_size must be >= 1 and data.shuffle_buffer >= 0")
        if self.streaming and self.path == EMBEDDED:
            raise ValueError(
                "data.streaming=true with data.path=embedded: the embedded corpus is small and cached; "
                "set data.streaming=false, or point data.path at a large corpus"
            )
        if self.mixture_exhausted not in ("repeat", "stop"):
            raise ValueError(f"data.mixture_exhausted={self.mixture_exhausted!r} must be `repeat` or `stop`")
        if self.mixture is not None:
            self._check_mixture()

    def _check_mixture(self) -> None:
        if not isinstance(self.mixture, (list, tuple)) or not self.mixture:
            raise ValueError(
                "data.mixture must be a non-empty list like [{path: /d/fineweb, weight: 0.7}, "
                "{path: /d/code, weight: 0.3}], or null for a single data.path"
            )
        self.mixture = [MixtureSource.from_value(v, f"data.mixture[{i}]") for i, v in enumerate(self.mixture)]
        if self.path != EMBEDDED:
            raise ValueError(
                f"data.mixture and data.path={self.path!r} are both set: a mixture lists its own "
                "directories; drop data.path (or put it in the mixture with a weight)"
            )
        if self.streaming:
            raise ValueError(
                "data.mixture reads prepared directories by memory map: set data.streaming=false"
            )

    @property
    def cache_root(self) -> str:
        """`cache_dir` with `~` expanded and made absolute (ranks may differ in cwd)."""
        return os.path.abspath(os.path.expanduser(self.cache_dir))


@dataclass(frozen=True)
class BatchGeometry:
    """How a step's data is cut, on this rank: the one value every loader takes (the global batch
    rule it follows: loader.py). Every rank passes the same values but its own `dp_rank`."""

    seq_len: int
    micro_batch_size: int
    accumulate_grad_batches: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {self.seq_len}")
        if self.micro_batch_size < 1 or self.accumulate_grad_batches < 1:
            raise ValueError("micro_batch_size and accumulate_grad_batches must be >= 1")
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"dp_rank={self.dp_rank} must be in [0, dp_size={self.dp_size})")

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step over all dp ranks."""
        return self.micro_batch_size * self.accumulate_grad_batches * self.dp_size

    def rank_offset(self, micro: int) -> int:
        """Where this rank's micro-batch `micro` of a step starts within the step's global batch."""
        return (self.dp_rank * self.accumulate_grad_batches + micro) * self.micro_batch_size
