"""Data pipeline: text (embedded stdlib corpus, local files or a hub dataset) -> tokenizer ->
token shards (scripts/prepare_data.py, or prepared once into the data cache) -> packed `seq_len`
blocks, alone or in a weighted mixture, or a stream of which each dp rank reads its own share ->
one loader (`PackedLoader`): dp-sharded, resumable micro-batches.

The recipe calls `build_datamodule(cfg.data, BatchGeometry(seq_len, micro_batch_size, ...))`;
everything else here is exported for tests, benchmarks and users assembling their own pipeline.
"""

from nanolight.data.config import EMBEDDED, BatchGeometry, DataConfig, DataError, MixtureSource
from nanolight.data.datamodule import DataModule, build_datamodule
from nanolight.data.loader import EvalLoader, PackedDataset, PackedLoader, document_fields, split_blocks
from nanolight.data.mixture import MixtureLoader, MixtureSchedule
from nanolight.data.preparation import PrepareConfig, prepare, token_file
from nanolight.data.shards import PreparedData
from nanolight.data.streaming import StreamingPackedLoader
from nanolight.data.tokenizer import load_tokenizer, vocab_size

__all__ = [
    "EMBEDDED",
    "BatchGeometry",
    "DataConfig",
    "DataError",
    "DataModule",
    "EvalLoader",
    "MixtureLoader",
    "MixtureSchedule",
    "MixtureSource",
    "PackedDataset",
    "PackedLoader",
    "PrepareConfig",
    "PreparedData",
    "StreamingPackedLoader",
    "build_datamodule",
    "document_fields",
    "load_tokenizer",
    "prepare",
    "split_blocks",
    "token_file",
    "vocab_size",
]
