"""Data pipeline: text (embedded stdlib corpus, local files or a hub dataset) -> tokenizer ->
cached flat token file -> packed `seq_len` blocks -> dp-sharded, resumable micro-batches.

The recipe calls `build_datamodule(cfg.data, seq_len, micro_batch_size, ...)`; everything else
here is exported for tests, benchmarks and users assembling their own pipeline.
"""

from nanolight.data.config import EMBEDDED, DataConfig
from nanolight.data.datamodule import DataModule, build_datamodule, token_file
from nanolight.data.loader import EvalLoader, PackedLoader
from nanolight.data.packed import PackedDataset, split_blocks
from nanolight.data.streaming import StreamingPackedLoader
from nanolight.data.tokenizer import load_tokenizer, vocab_size

__all__ = [
    "EMBEDDED",
    "DataConfig",
    "DataModule",
    "EvalLoader",
    "PackedDataset",
    "PackedLoader",
    "StreamingPackedLoader",
    "build_datamodule",
    "load_tokenizer",
    "split_blocks",
    "token_file",
    "vocab_size",
]
