"""Sharded checkpoints: each rank writes what it owns, one index maps the pieces to global tensors.

`index.py` is the format, `writer.py` one rank's write and the merge into the index, `reader.py`
reads any block of any tensor (so any topology can load what any other saved). Which rank owns
which piece, and the atomic directory protocol, are in ``nanolight/strategies/sharded_checkpoint.py``.
"""

from nanolight.checkpoint.sharded.index import FORMAT, INDEX_FILE, CheckpointIndex, Shard, TensorEntry
from nanolight.checkpoint.sharded.reader import ShardedReader, is_sharded_checkpoint, read_model_state
from nanolight.checkpoint.sharded.writer import ShardWriter, fsync_path, merge_parts, write_index

__all__ = [
    "FORMAT",
    "INDEX_FILE",
    "CheckpointIndex",
    "Shard",
    "ShardWriter",
    "ShardedReader",
    "TensorEntry",
    "fsync_path",
    "is_sharded_checkpoint",
    "merge_parts",
    "read_model_state",
    "write_index",
]
