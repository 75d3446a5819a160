"""Tokenize a corpus once into token shards that `data.path=<out>` trains from.

    python scripts/prepare_data.py --source HuggingFaceFW/fineweb-edu --name sample-10BT \
        --tokenizer HuggingFaceTB/SmolLM-135M --out /data/fineweb-edu-10BT --num-proc 16
    python scripts/prepare_data.py --source '/data/code/*.jsonl' --tokenizer HuggingFaceTB/SmolLM-135M \
        --out /data/code --num-proc 16
    python scripts/prepare_data.py --source embedded --tokenizer embedded --out /data/stdlib

Killed or stopped, it continues where it stopped when run again with the same arguments (and a
run on a directory whose shards were damaged re-tokenizes from the first damaged one). The same
inputs give byte-identical shards at any --num-proc.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

try:
    import nanolight  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanolight.data import DataConfig, DataError, PrepareConfig, prepare  # noqa: E402

OUTPUT_FLAGS = ("out", "shard_size_mb", "chunk_docs")  # the rest are the run's data keys (`dest`)


def parse_args(argv: list[str] | None = None) -> PrepareConfig:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--source", dest="path", required=True, help="hub dataset id, local file/dir/glob, or `embedded`"
    )
    p.add_argument("--name", default=None, help="hub dataset config name (e.g. sample-10BT)")
    p.add_argument("--split", default="train")
    p.add_argument("--revision", default=None, help="hub dataset revision (pin it for reproducible shards)")
    p.add_argument("--text-field", default="text", help="the column holding each document's text")
    p.add_argument("--tokenizer", required=True, help="tokenizer directory, hub id, or `embedded`")
    p.add_argument("--out", required=True, help="directory for index.json, shards and the tokenizer")
    p.add_argument("--num-proc", type=int, default=1, help="datasets.map worker processes (1: one threaded)")
    p.add_argument("--shard-size-mb", type=float, default=256.0, help="MB of tokens per shard")
    p.add_argument(
        "--chunk-docs", type=int, default=None, help="documents per commit (default 20000 x num-proc)"
    )
    p.add_argument(
        "--batch-size", dest="tokenize_batch_size", type=int, default=256, help="documents per tokenizer call"
    )
    p.add_argument(
        "--cache-dir", default="~/.cache/nanolight", help="embedded corpus/tokenizer, datasets cache"
    )
    flags = vars(p.parse_args(argv))
    output = {k: flags.pop(k) for k in OUTPUT_FLAGS}
    return PrepareConfig(DataConfig(**flags), **output)  # every other flag is the data key of its dest


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_args(argv)
        start = time.perf_counter()
        index = prepare(cfg)
    except (DataError, ValueError, FileNotFoundError, OSError) as err:
        print(f"prepare_data: error: {err}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - start
    print(
        f"{cfg.out}: {index['num_documents']:,} documents, {index['num_tokens']:,} tokens ({index['dtype']}) "
        f"in {len(index['shards'])} shard(s); {seconds:.1f} s this run. Train on it with data.path={cfg.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
