"""`DataConfig`: what text to train on, how to tokenize it, and where the token cache lives.

The schema lives next to the data pipeline it configures (DESIGN.md) and validates itself in
`__post_init__`, so a bad `data=` override fails in the parent process with a message that says
which key is wrong and how to fix it, before any rank tokenizes anything.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

EMBEDDED = "embedded"
"""The `path`/`tokenizer` value that selects the built-in, offline corpus and BPE tokenizer."""


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
    cache_dir: where the embedded corpus, embedded tokenizer and token files are written once
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
    shuffle_buffer: streaming only: blocks held in the shuffle buffer (0 = stream order).
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

    @property
    def cache_root(self) -> str:
        """`cache_dir` with `~` expanded and made absolute (ranks may differ in cwd)."""
        return os.path.abspath(os.path.expanduser(self.cache_dir))
