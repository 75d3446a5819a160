"""Measure the data pipeline on the embedded corpus: one-off build costs and per-step loader time.

    python scripts/bench_data.py                      # fresh temporary cache: measures every build
    python scripts/bench_data.py --num-proc 2         # tokenization through datasets.map workers
    python scripts/bench_data.py --cache-dir ~/.cache/nanolight --steps 500

Prints the corpus size, tokenizer training time, tokenization throughput (tokens/s), the
cache-hit rebuild time and the loader's time per step (ms) at the recipe's default shape.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

try:
    import nanolight  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanolight.data import DataConfig, build_datamodule, token_file  # noqa: E402
from nanolight.data.corpus import embedded_corpus  # noqa: E402
from nanolight.data.tokenizer import embedded_tokenizer_dir, load_tokenizer  # noqa: E402


def _cpu_seconds() -> float:
    """CPU time of this process and its reaped children (the datasets.map workers)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cache-dir", default=None, help="default: a fresh temporary directory")
    parser.add_argument("--max-mb", type=float, default=20.0, help="embedded corpus cap (MB)")
    parser.add_argument("--num-proc", type=int, default=None, help="datasets.map workers for tokenization")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        cfg = DataConfig(cache_dir=args.cache_dir or tmp, embedded_max_mb=args.max_mb, num_proc=args.num_proc)
        t0 = time.perf_counter()
        corpus = embedded_corpus(cfg.cache_root, cfg.embedded_max_mb)
        t1 = time.perf_counter()
        tok = load_tokenizer(embedded_tokenizer_dir(cfg, corpus))
        t2, c2 = time.perf_counter(), _cpu_seconds()
        tf = token_file(cfg, tok, corpus)
        t3, c3 = time.perf_counter(), _cpu_seconds()
        n_tok = len(tf.tokens)
        print(f"corpus: {os.path.getsize(corpus) / 1e6:.1f} MB jsonl, written in {t1 - t0:.2f} s")
        print(f"tokenizer: {len(tok)} ids, trained/loaded in {t2 - t1:.2f} s")
        print(
            f"tokenize: {n_tok:,} tokens in {t3 - t2:.2f} s = {n_tok / (t3 - t2):,.0f} tokens/s "
            f"(build-time figure in meta.json: {tf.meta['tokens_per_s']:,} tokens/s; {n_tok / (c3 - c2):,.0f} "
            f"tokens per CPU-second over {os.cpu_count()} cores, the figure that survives a busy machine)"
        )
        t4 = time.perf_counter()
        train, _, _ = build_datamodule(cfg, args.seq_len, args.micro_batch_size, seed=0)
        t5 = time.perf_counter()
        print(f"build_datamodule on a warm cache: {(t5 - t4) * 1e3:.1f} ms")
        it = iter(train)
        next(it)
        steps, t6 = 0, time.perf_counter()
        while steps < args.steps:
            try:
                next(it)
            except StopIteration:
                it = iter(train)
                continue
            steps += 1
        dt = (time.perf_counter() - t6) / steps
        print(
            f"loader: {dt * 1e3:.3f} ms/step (micro_batch_size={args.micro_batch_size}, seq_len={args.seq_len}, "
            f"{args.micro_batch_size * args.seq_len / dt:,.0f} tokens/s)"
        )


if __name__ == "__main__":
    main()
