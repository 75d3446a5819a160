"""Training from a directory made by scripts/prepare_data.py: checks, tokenizer, loaders.

The shards are one token stream packed into `seq_len` samples and served by the same
`PackedLoader` as the flat token file -- one seeded permutation over all samples, global batch
s = order[s*G:(s+1)*G], rank r's slice of it -- so every layout sees the same global batch at
every step, resuming is a consumed-samples counter, and the same documents give the same
batches whether they come from a prepared directory or a token file. A rank reads only its own
samples' bytes (`TokenShards` maps a shard when one of them first touches it).
"""

from __future__ import annotations

import os

from transformers import PreTrainedTokenizerBase

from nanolight.data.config import EMBEDDED, DataConfig, DataError
from nanolight.data.loader import EvalLoader, PackedLoader
from nanolight.data.mixture import ConcatBlocks, MixtureLoader
from nanolight.data.packed import PackedDataset, split_blocks
from nanolight.data.shards import INDEX, PreparedData
from nanolight.data.tokenizer import load_tokenizer, tokenizer_identity


def open_prepared(path: str, key: str = "data.path") -> PreparedData:
    """Open a prepared directory; a missing path names the config key that holds it."""
    if not os.path.isdir(os.path.expanduser(path)):
        raise DataError(
            f"{key}={path!r} is not a directory: name one made by scripts/prepare_data.py --out <dir>"
        )
    return PreparedData.open(path)


def run_tokenizer(sources: list[tuple[str, PreparedData]], tokenizer: str) -> PreTrainedTokenizerBase:
    """The run's tokenizer: `tokenizer` if named (it must be the data's), else the one saved with the data.

    Every source must come from that tokenizer: token ids from another tokenizer mean other text,
    and nothing downstream could tell.
    """
    first = sources[0][1]
    tok = load_tokenizer(first.tokenizer_dir if tokenizer == EMBEDDED else tokenizer)
    identity = tokenizer_identity(tok)
    run_name = (
        tokenizer if tokenizer != EMBEDDED else f"{first.tokenizer['name']!r} from {first.tokenizer_dir}"
    )
    for key, data in sources:
        saved = data.tokenizer
        if saved["identity"] != identity:
            raise DataError(
                f"{key}={data.path}: {os.path.join(data.path, INDEX)} says its tokens come from tokenizer "
                f"{saved['name']!r} (identity {saved['identity']}, {saved['vocab_size']} ids), but this run's "
                f"tokenizer is {run_name} (identity {identity}, {len(tok)} ids). Prepare every source with the "
                "same --tokenizer, and set data.tokenizer to it or leave it at `embedded` (the data's own)"
            )
    return tok


def prepared_blocks(
    data: PreparedData, cfg: DataConfig, seq_len: int, document_eos: int | None
) -> tuple[PackedDataset, PackedDataset]:
    """(train, val) datasets of a prepared directory, held out exactly as for a token file."""
    n_blocks = len(data.tokens) // seq_len
    train_ids, val_ids = split_blocks(n_blocks, cfg.val_fraction, cfg.val_blocks)  # the same at every layout
    make = lambda ids: PackedDataset(data.tokens, seq_len, ids, document_eos)  # noqa: E731
    return make(train_ids), make(val_ids)


def build_prepared(
    cfg: DataConfig, seq_len: int, micro_batch_size: int, accumulate_grad_batches: int,
    dp_rank: int, dp_size: int, seed: int,
) -> tuple[PackedLoader, EvalLoader | None, PreTrainedTokenizerBase]:  # fmt: skip
    """Loaders over `cfg.path` (a prepared directory) and the run's tokenizer."""
    data = open_prepared(cfg.path)
    tok = run_tokenizer([("data.path", data)], cfg.tokenizer)
    eos = tok.eos_token_id if cfg.document_mask else None
    train, val = prepared_blocks(data, cfg, seq_len, eos)
    loader = PackedLoader(train, micro_batch_size, accumulate_grad_batches, dp_rank, dp_size, seed)
    return loader, eval_loader(val, micro_batch_size, dp_rank, dp_size), tok


def eval_loader(
    val: PackedDataset | ConcatBlocks, micro_batch_size: int, dp_rank: int, dp_size: int
) -> EvalLoader | None:
    """The validation loader, None without held-out blocks; fewer than one batch is an error."""
    if len(val) == 0:
        return None
    if len(val) < micro_batch_size * dp_size:
        raise ValueError(
            f"the validation split has {len(val)} blocks, fewer than one validation batch "
            f"(micro_batch_size={micro_batch_size} x dp={dp_size}); raise data.val_fraction / data.val_blocks, "
            "or set data.val_fraction=0 for no validation"
        )
    return EvalLoader(val, micro_batch_size, dp_rank, dp_size)


def build_mixture(
    cfg: DataConfig, seq_len: int, micro_batch_size: int, accumulate_grad_batches: int,
    dp_rank: int, dp_size: int, seed: int,
) -> tuple[MixtureLoader, EvalLoader | None, PreTrainedTokenizerBase]:  # fmt: skip
    """Loaders over `cfg.mixture` (prepared directories with weights); validation = every source's held-out part."""
    assert cfg.mixture is not None
    keys = [f"data.mixture[{i}].path" for i in range(len(cfg.mixture))]
    opened = [(k, open_prepared(m.path, k)) for k, m in zip(keys, cfg.mixture, strict=True)]
    tok = run_tokenizer(opened, cfg.tokenizer)
    eos = tok.eos_token_id if cfg.document_mask else None
    splits = [prepared_blocks(data, cfg, seq_len, eos) for _, data in opened]
    names = [f"data.mixture[{i}] ({m.name or m.path})" for i, m in enumerate(cfg.mixture)]
    loader = MixtureLoader(
        [train for train, _ in splits], [m.weight for m in cfg.mixture], names,
        micro_batch_size, accumulate_grad_batches, dp_rank, dp_size, seed, cfg.mixture_exhausted,
    )  # fmt: skip
    val = ConcatBlocks([v for _, v in splits])
    return loader, eval_loader(val, micro_batch_size, dp_rank, dp_size), tok  # type: ignore[arg-type]
