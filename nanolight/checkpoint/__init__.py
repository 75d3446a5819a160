"""Checkpoints: the on-disk formats and their atomic protocol, in one place.

`atomic.py` (complete or absent: every writer), `files.py` (one file, errors that name it),
`index.py` / `writer.py` / `reader.py` (the format: any block of any tensor, whatever layout wrote
it), `save.py` (one process's files, or every rank's shards + the index), `load.py` (resharding
into this rank's layout), `pretrained.py` (model directories) and `hf.py` (Hugging Face)."""

from nanolight.checkpoint.atomic import LAST_POINTER, atomic_directory, resolve_checkpoint, write_last_pointer
from nanolight.checkpoint.files import CheckpointError, MissingCheckpointFile
from nanolight.checkpoint.hf import convert_hf_to_nanolight, convert_nanolight_to_hf
from nanolight.checkpoint.index import INDEX_FILE, CheckpointIndex
from nanolight.checkpoint.pretrained import load_pretrained, read_checkpoint, save_pretrained
from nanolight.checkpoint.reader import CheckpointReader, is_sharded_checkpoint

__all__ = [
    "INDEX_FILE",
    "LAST_POINTER",
    "CheckpointError",
    "CheckpointIndex",
    "CheckpointReader",
    "MissingCheckpointFile",
    "atomic_directory",
    "convert_hf_to_nanolight",
    "convert_nanolight_to_hf",
    "is_sharded_checkpoint",
    "load_pretrained",
    "read_checkpoint",
    "resolve_checkpoint",
    "save_pretrained",
    "write_last_pointer",
]
