"""Checkpoints: the on-disk formats and their atomic protocol, in one place.

`atomic.py` (complete or absent: every writer; one file, errors that name it),
`index.py` / `reader.py` (the format: any block of any tensor, whatever layout wrote it; which
checkpoint is intact), `save.py` (the one writer: every rank's shards + the index, one process
the one-shard case), `load.py` (resharding into this rank's layout), `pretrained.py` (model
directories read and written). No model is known here: the Llama's own loading and Hugging Face
conversion are `models/pretrained.py`'s."""

from nanolight.checkpoint.atomic import (
    LAST_POINTER,
    CheckpointError,
    MissingCheckpointFile,
    atomic_directory,
    resolve_checkpoint,
    write_last_pointer,
)
from nanolight.checkpoint.index import INDEX_FILE, CheckpointIndex
from nanolight.checkpoint.reader import CheckpointReader, is_sharded_checkpoint
from nanolight.checkpoint.save import ExportExtras

__all__ = [
    "INDEX_FILE",
    "LAST_POINTER",
    "CheckpointError",
    "CheckpointIndex",
    "CheckpointReader",
    "ExportExtras",
    "MissingCheckpointFile",
    "atomic_directory",
    "is_sharded_checkpoint",
    "resolve_checkpoint",
    "write_last_pointer",
]
