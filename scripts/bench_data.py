"""Measure the data pipeline against what it must keep up with. Ratios from one run, alternating, medians.

    python scripts/bench_data.py                 # the embedded corpus (stdlib source) x 6 and x 2, 3 reps
    python scripts/bench_data.py --reps 5 --repeat 3 --cache-dir ~/.cache/nanolight

1. preparation: `prepare(num_proc=2)` end to end (open, tokenize in datasets.map workers, write and
   fsync shards) vs the raw `tokenizers` batch encode (`encode_batch`, `encode_batch_fast`) of the
   same documents in memory, each in a fresh process: tokens per second and per CPU-second (the
   figure a busy machine moves least), end to end and in steady state (the x6 run minus the x2 run);
2. loader time per step (prepared data, a two-source mixture, a stream) vs the smollm-tiny training
   step (forward, backward, AdamW) at the recipe's shape on this machine's CPU;
3. resume cost: a fresh loader restored at sample 0 and at sample 10^6 (a mixture also at 10^9,
   a stream at 10^5), timed to its first batch.
Timings on a shared machine move by +-20%: read the ratios, and never assert on them in a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

try:
    import nanolight  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanolight.data import (  # noqa: E402
    BatchGeometry,
    DataConfig,
    MixtureLoader,
    PackedDataset,
    PackedLoader,
    PrepareConfig,
    PreparedData,
    StreamingPackedLoader,
    build_datamodule,
    prepare,
)
from nanolight.data.shards import ShardWriter  # noqa: E402
from nanolight.data.sources import embedded_corpus, open_local  # noqa: E402
from nanolight.data.tokenizer import embedded_tokenizer_dir, load_tokenizer  # noqa: E402
from nanolight.models.llama import LlamaForCausalLM  # noqa: E402
from nanolight.models.llama_config import LlamaConfig  # noqa: E402


def median_times(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median wall seconds of each function, run in turn (a, b, c, a, b, c, ...) so drift hits all alike."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def _cpu() -> float:
    """CPU seconds of this process (all its threads) and of its reaped children (map workers)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _child(kind: str, corpus: str, tok_dir: str, out: str) -> None:
    """One timed measurement in a fresh process, printed as JSON: a process that has forked
    datasets.map workers runs its own tokenizer on fewer threads afterwards, which would bias
    whichever side ran second."""
    if kind == "prepare":
        start, cpu = time.perf_counter(), _cpu()
        data = DataConfig(path=corpus, tokenizer=tok_dir, num_proc=2, tokenize_batch_size=256)
        index = prepare(PrepareConfig(data, out), progress=False)
        wall, cpu = time.perf_counter() - start, _cpu() - cpu
        n = {"tokens": index["num_tokens"], "documents": index["num_documents"]}
        print(json.dumps({"prepare": wall, "prepare_cpu": cpu, **n}))
        return
    backend = load_tokenizer(tok_dir).backend_tokenizer
    texts = [json.loads(line)["text"] for line in open(corpus)]
    result: dict[str, float] = {"documents": len(texts)}
    for name in ("encode_batch", "encode_batch_fast"):
        start, cpu = time.perf_counter(), _cpu()
        getattr(backend, name)(texts, add_special_tokens=False)
        result[name], result[f"{name}_cpu"] = time.perf_counter() - start, _cpu() - cpu
    print(json.dumps(result))


def bench_prepare(corpus: str, small: str, tok_dir: str, work: str, reps: int) -> None:
    """`corpus` and `small` hold the same documents, `small` fewer times: the difference of their
    preparation times is the steady-state cost, without start-up (imports, opening, worker start)."""

    def child(kind: str, source: str, out: str = "") -> dict:
        cmd = [sys.executable, __file__, "--child", kind, source, tok_dir, out]
        return json.loads(
            subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1]
        )

    child("prepare", corpus, f"{work}/prep-0")  # warm: arrow conversion of both sources, the page cache
    child("prepare", small, f"{work}/prep-small-0")
    raw, big, little = [], [], []
    for r in range(reps):  # alternating, so drift on a shared machine hits all alike
        raw.append(child("raw", corpus))
        big.append(child("prepare", corpus, f"{work}/prep-{r + 1}"))
        little.append(child("prepare", small, f"{work}/prep-small-{r + 1}"))
    docs = raw[0]["documents"]
    doc_tokens = big[0]["tokens"] - big[0]["documents"]  # the raw encodes add no EOS
    small_tokens = little[0]["tokens"] - little[0]["documents"]
    med = statistics.median
    wall = {k: med(x[k] for x in raw) for k in ("encode_batch", "encode_batch_fast")}
    cpu = {k: med(x[f"{k}_cpu"] for x in raw) for k in ("encode_batch", "encode_batch_fast")}
    wall["prepare"], cpu["prepare"] = med(x["prepare"] for x in big), med(x["prepare_cpu"] for x in big)
    steady = med(b["prepare"] - s["prepare"] for b, s in zip(big, little, strict=True))
    steady_cpu = med(b["prepare_cpu"] - s["prepare_cpu"] for b, s in zip(big, little, strict=True))
    mb = os.path.getsize(corpus) / 1e6
    print(f"1. preparation, {docs} documents, {mb:.1f} MB, {doc_tokens:,} tokens (medians of {reps}):")
    for k in wall:
        print(
            f"   {k:18s} {wall[k]:6.2f} s  {doc_tokens / wall[k] / 1e6:5.2f} M tokens/s   "
            f"{cpu[k]:6.2f} CPU-s  {doc_tokens / cpu[k] / 1e6:5.2f} M tokens/CPU-s"
        )
    extra = doc_tokens - small_tokens
    print(
        f"   prepare, steady state ({extra:,} more tokens): {steady:.2f} s  {extra / steady / 1e6:5.2f} M tokens/s   "
        f"{steady_cpu:.2f} CPU-s  {extra / steady_cpu / 1e6:5.2f} M tokens/CPU-s"
    )
    for base in ("encode_batch", "encode_batch_fast"):
        rate = doc_tokens / wall[base]
        print(
            f"   prepare(num_proc=2) / {base}: end to end {doc_tokens / wall['prepare'] / rate:.2f}, "
            f"steady state {extra / steady / rate:.2f}; per CPU-second {cpu[base] / cpu['prepare']:.2f}  "
            "(target >= 0.8)"
        )


def per_step(loader: object, steps: int) -> Callable[[], None]:
    """`steps` batches from a loader warmed by one batch (its first window or shard opened)."""
    it = iter(loader)  # type: ignore[call-overload]
    next(it)
    return lambda: [next(it) for _ in range(steps)]


def bench_loader_vs_step(prep_dir: str, corpus: str, tok_dir: str, steps: int, reps: int) -> None:
    mbs, seq, window = 8, 256, 1024
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.preset("smollm-tiny"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = next(iter(build_datamodule(DataConfig(path=prep_dir), BatchGeometry(seq, mbs)).train_loader))

    def train_step() -> None:
        loss = model(batch["input_ids"], target_ids=batch["target_ids"])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    mix = DataConfig(mixture=[{"path": prep_dir, "weight": 0.7}, {"path": prep_dir, "weight": 0.3}])
    stream = DataConfig(
        path=corpus, tokenizer=tok_dir, streaming=True, shuffle_buffer=window, tokenize_batch_size=64
    )
    n_mapped, n_stream = 500, 3 * window // mbs  # the stream over three shuffle windows, refills included
    counts = {"prepared loader": n_mapped, "mixture loader": n_mapped, "stream loader": n_stream}
    fns = {
        "train step": lambda: [train_step() for _ in range(steps)],
        "prepared loader": per_step(
            build_datamodule(DataConfig(path=prep_dir), BatchGeometry(seq, mbs, seed=1)).train_loader,
            n_mapped,
        ),
        "mixture loader": per_step(
            build_datamodule(mix, BatchGeometry(seq, mbs, seed=1)).train_loader, n_mapped
        ),
        "stream loader": per_step(
            build_datamodule(stream, BatchGeometry(seq, mbs, seed=1)).train_loader, n_stream
        ),
    }
    train_step()  # warm-up
    t = median_times(fns, reps)
    step = t["train step"] / steps
    print(
        f"2. time per step, micro_batch_size={mbs} seq_len={seq}, smollm-tiny fp32 on "
        f"{torch.get_num_threads()} threads (medians of {reps}):"
    )
    print(f"   train step        {step * 1e3:8.1f} ms")
    for k, n in counts.items():
        ms = t[k] / n * 1e3
        print(f"   {k:17s} {ms:8.3f} ms  = {ms / (step * 1e3) * 100:.3f}% of the step (target < 1%)")


def synthetic_prepared(out: str, n_tokens: int, eos: int = 0) -> PreparedData:
    """A prepared directory of random tokens in ~100-token documents (no tokenizer needed)."""
    rng = np.random.default_rng(0)
    os.makedirs(out)
    writer = ShardWriter(out, np.dtype(np.uint16), shard_tokens=n_tokens // 3)
    tokens = rng.integers(1, 8192, size=n_tokens, dtype=np.uint16)
    ends = np.arange(100, n_tokens + 1, 100)
    tokens[ends - 1] = eos
    writer.add(tokens, ends, np.arange(len(ends)))
    tok = {"name": "synthetic", "identity": "-", "eos_token_id": eos, "vocab_size": 8192}
    writer.finish(
        {"format": "nanolight-tokens", "version": 1, "dtype": "uint16", "tokenizer": tok}, len(ends)
    )
    return PreparedData.open(out)


def bench_resume(work: str, corpus: str, tok_dir: str, reps: int) -> None:
    seq, mbs = 16, 8
    data = synthetic_prepared(f"{work}/synthetic", 1_100_000 * seq)

    def packed(at: int) -> Callable[[], object]:
        def run() -> object:
            loader = PackedLoader(PackedDataset(data.tokens, seq), BatchGeometry(seq, mbs, seed=1))
            loader.load_state_dict(
                {"epoch": 0, "samples_consumed": at, "micro_batches_in_step": 0, "seed": 1}
            )
            return next(iter(loader))

        return run

    def mixture(at: int) -> Callable[[], object]:
        def run() -> object:
            sources = [PackedDataset(data.tokens, seq), PackedDataset(data.tokens, seq)]
            loader = MixtureLoader(sources, [0.7, 0.3], ["a", "b"], BatchGeometry(seq, mbs, seed=1))
            state = loader.state_dict()
            loader.load_state_dict({**state, "samples_consumed": at})
            return next(iter(loader))

        return run

    tok = load_tokenizer(tok_dir)
    ds = open_local([corpus], streaming=True, cache_dir=f"{work}/hf")
    kw = {"tokenize_batch_size": 64}
    warm = StreamingPackedLoader(ds, tok, "text", BatchGeometry(seq, mbs, seed=1), **kw)
    it = iter(warm)
    for _ in range(100_000 // mbs):
        next(it)
    late = warm.state_dict()
    fresh = StreamingPackedLoader(ds, tok, "text", BatchGeometry(seq, mbs, seed=1), **kw).state_dict()

    def streaming(state: dict) -> Callable[[], object]:
        def run() -> object:
            loader = StreamingPackedLoader(ds, tok, "text", BatchGeometry(seq, mbs, seed=1), **kw)
            loader.load_state_dict(state)
            return next(iter(loader))

        return run

    cases = {"prepared @ 0": packed(0), "prepared @ 10^6": packed(10**6)}
    cases |= {
        "mixture @ 0": mixture(0),
        "mixture @ 10^6": mixture(10**6),
        "mixture @ 10^9": mixture(10**9),
    }
    cases |= {"stream @ 0": streaming(fresh), "stream @ 10^5": streaming(late)}
    with warnings.catch_warnings():  # a stream's pass ends and a source's repeat are expected here
        warnings.simplefilter("ignore")
        t = median_times(cases, reps)
    print(
        f"3. resume cost (new loader, load_state_dict, first batch), {len(data.tokens) // seq:,} samples of {seq}:"
    )
    for k, v in t.items():
        print(f"   {k:16s} {v * 1e3:8.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cache-dir", default=None, help="embedded corpus/tokenizer cache (default: temporary)"
    )
    parser.add_argument("--max-mb", type=float, default=20.0, help="embedded corpus size (MB of source)")
    parser.add_argument(
        "--repeat", type=int, default=6, help="the corpus this many times (and a third of it)"
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="training steps per timed repetition")
    parser.add_argument("--child", nargs=4, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(*args.child)
        return
    with tempfile.TemporaryDirectory() as work:
        cfg = DataConfig(cache_dir=args.cache_dir or f"{work}/cache", embedded_max_mb=args.max_mb)
        corpus = embedded_corpus(cfg.cache_root, cfg.embedded_max_mb)
        tok_dir = embedded_tokenizer_dir(cfg, corpus)
        with open(corpus) as f:  # the same documents several times: start-up costs apart
            lines = f.readlines()
        sources = []
        for times in (max(1, args.repeat // 3), args.repeat):
            sources.append(f"{work}/corpus-x{times}.jsonl")
            with open(sources[-1], "w") as f:
                f.writelines(lines * times)
        bench_prepare(sources[1], sources[0], tok_dir, work, args.reps)
        bench_loader_vs_step(f"{work}/prep-0", corpus, tok_dir, args.steps, args.reps)
        bench_resume(work, corpus, tok_dir, args.reps)


if __name__ == "__main__":
    main()
