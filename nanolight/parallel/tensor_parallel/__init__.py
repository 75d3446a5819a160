"""Tensor parallelism: sharded layers, autograd collectives, vocab-parallel loss, plan application."""

from nanolight.parallel.tensor_parallel.apply import (
    apply_tensor_parallel,
    gather_full,
    shard_chunks,
    shard_dims,
    take_shard,
)
from nanolight.parallel.tensor_parallel.cross_entropy import (
    VocabParallelCrossEntropyLoss,
    vocab_parallel_cross_entropy,
)
from nanolight.parallel.tensor_parallel.layers import (
    TP_LAYERS,
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

__all__ = [
    "TP_LAYERS",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelCrossEntropyLoss",
    "VocabParallelEmbedding",
    "apply_tensor_parallel",
    "gather_full",
    "shard_chunks",
    "shard_dims",
    "take_shard",
    "vocab_parallel_cross_entropy",
]
