"""Checkpoint save/load speed: Parallel3DStrategy's sharded checkpoint vs raw safetensors, one run.

    python scripts/bench_checkpoint.py                   # world 1 and tp=2 (gloo, CPU), a ~50M-param Llama
    python scripts/bench_checkpoint.py --layout dp2-zero1 --hidden 768 --layers 12 --repeats 7

For each world size, every rank builds the same Llama through `Parallel3DStrategy` (on meta, then
only its shards), runs one optimizer step (AdamW: both moments exist), then alternates, `--repeats`
times, four timed operations (the order flips every repeat):

  nanolight save  `strategy.save_checkpoint(dir, state)`: each rank's safetensors shards, index,
                  per-rank files, fsync, atomic rename -- what a training run does
  raw save        `safetensors.torch.save_file` of the very tensors this rank's nanolight shard
                  files hold (read back from them), one file per rank, then fsync (file + dir)
  nanolight load  `strategy.load_checkpoint(dir)`: validate the index, read and reslice weights and
                  optimizer state into the live model/optimizer
  raw load        `safetensors.torch.load_file` of the raw files, copied into existing tensors
                  (load_file only memory-maps; the copy reads the bytes, as a resume's copy into
                  the live model does)

Both saves include fsync. Before every load the benchmark's own files are dropped from the page
cache (`posix_fadvise(DONTNEED)`; `--warm` keeps them), so a load reads the disk as a resuming
job would (a VM disk may still be cached by its host). GB/s = tensor bytes of all ranks (model
weights + optimizer state: the same bytes on both sides) / wall time from a barrier to the last
rank's finish; the median over the repeats is printed, with nanolight/raw.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from nanolight.checkpoint.atomic import fsync_path
from nanolight.models import LlamaConfig, LlamaForCausalLM
from nanolight.module import NanoModule
from nanolight.strategies.parallel3d import Parallel3DStrategy
from nanolight.trainer import NanoTrainer

LAYOUTS = {  # world-2 layouts: (tp, pp, dp, zero_stage)
    "tp2": (2, 1, 1, 0),
    "dp2-zero1": (1, 1, 2, 1),
    "pp2": (1, 2, 1, 0),
}
OPS = ("nanolight-save", "raw-save", "nanolight-load", "raw-load")


class BenchLM(NanoModule):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model: LlamaForCausalLM | None = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = LlamaForCausalLM(self.config)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(batch, labels=batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def build_config(args: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )


def setup(layout: tuple[int, int, int, int], args: argparse.Namespace) -> Parallel3DStrategy:
    """`NanoTrainer.fit` for one AdamW step: the model sharded, the optimizer state filled."""
    tp, pp, dp, zero_stage = layout
    strategy = Parallel3DStrategy(tp=tp, pp=pp, dp=dp, zero_stage=zero_stage, init_seed=0)
    ids = torch.randint(0, args.vocab, (1, 32), generator=torch.Generator().manual_seed(0))
    micro = max(1, pp)  # 1F1B wants at least pp micro-batches
    trainer = NanoTrainer(
        max_steps=1, accumulate_grad_batches=micro, strategy=strategy, logger=False,
        enable_progress_bar=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(BenchLM(build_config(args)), train_dataloaders=[ids] * micro)
    return strategy


def own_files(step_dir: Path, coords: dict[str, int]) -> list[str]:
    """The tensor files this rank wrote (the index records the writer of every shard)."""
    index = json.loads((step_dir / "index.json").read_text())
    mine = {
        shard["file"]
        for entry in index["tensors"].values()
        for shard in entry["shards"]
        if all(shard[k] == v for k, v in coords.items())
    }
    return sorted(mine)


def drop_cache(paths: list[Path]) -> None:
    """Evict these (clean, fsynced) files from the page cache: the next read goes to the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_load(path: Path, into: dict[str, torch.Tensor]) -> None:
    """Read a file into existing tensors, as a resume fills the live model and optimizer.

    The copy is what reads the bytes: `load_file` only maps the file (its tensors are views of the
    mapping, paged in on first touch), so timing `load_file` alone would time no disk at all."""
    for name, tensor in load_file(str(path)).items():
        into[name].copy_(tensor)


def timed(fn: Callable[[], object]) -> float:
    """Wall time from a common start to the slowest rank's finish."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # every rank -> the slowest one's time
    return elapsed.item()


def worker(
    rank: int, world: int, port: int, layout: tuple, root: str, args: argparse.Namespace, out: dict
) -> None:
    torch.set_num_threads(args.threads)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(minutes=10),
    )
    strategy = setup(layout, args)
    ctx = strategy.parallel.context
    coords = {"pp": ctx.pp_rank, "tp": ctx.tp_rank, "dp": ctx.dp_rank}
    base = Path(root)
    state = {"format": "bench"}  # the trainer's part (progress, rng, ...) is a few KB: not measured

    # the raw side writes exactly the tensors of this rank's nanolight shard files
    probe = base / "probe"
    strategy.save_checkpoint(probe, state)
    files = own_files(probe, coords)
    # cloned: safetensors' load_file returns tensors backed by the (lazily read) memory-mapped file
    tensors = {f"{f}/{k}": v.clone() for f in files for k, v in load_file(str(probe / f)).items()}
    nbytes = torch.tensor([sum(t.numel() * t.element_size() for t in tensors.values())], dtype=torch.float64)
    dist.all_reduce(nbytes)  # the bytes of all ranks
    dist.barrier()
    if rank == 0:
        shutil.rmtree(probe)

    times: dict[str, list[float]] = {op: [] for op in OPS}
    for i in range(args.repeats):
        nl_dir, raw_dir = base / f"nl-{i}", base / f"raw-{i}"
        raw_file = raw_dir / f"rank-{rank:05d}.safetensors"
        if rank == 0:
            raw_dir.mkdir()
        dist.barrier()

        def raw_save(raw_dir: Path = raw_dir, raw_file: Path = raw_file) -> None:
            save_file(tensors, str(raw_file))
            fsync_path(raw_file)
            fsync_path(raw_dir)

        saves = {
            "nanolight-save": lambda nl_dir=nl_dir: strategy.save_checkpoint(nl_dir, state),
            "raw-save": raw_save,
        }
        for op in OPS[:2] if i % 2 == 0 else OPS[1::-1]:
            times[op].append(timed(saves[op]))
        dist.barrier()
        if not args.warm:
            drop_cache([p for p in nl_dir.iterdir() if p.is_file()] + [raw_file])
        loads = {
            "nanolight-load": lambda nl_dir=nl_dir: strategy.load_checkpoint(nl_dir),
            "raw-load": lambda raw_file=raw_file: raw_load(raw_file, tensors),
        }
        for op in OPS[2:] if i % 2 == 0 else OPS[:1:-1]:
            times[op].append(timed(loads[op]))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(nl_dir)
            shutil.rmtree(raw_dir)
    if rank == 0:
        out[world] = {"bytes": nbytes.item(), **{op: statistics.median(t) for op, t in times.items()}}
        with torch.device("meta"):
            out["params"] = sum(p.numel() for p in LlamaForCausalLM(build_config(args)).parameters())
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="tp2", help="the 2-rank layout")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warm", action="store_true", help="load from the page cache (no eviction)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir under /tmp)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    from torch.distributed.elastic.utils.distributed import get_free_port

    results: dict = {}
    with mp.Manager() as manager:
        out = manager.dict()
        for world in args.worlds:
            layout = LAYOUTS[args.layout] if world == 2 else (1, 1, 1, 0)
            root = tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir)
            try:
                mp.spawn(
                    worker, args=(world, get_free_port(), layout, root, args, out), nprocs=world, join=True
                )
            finally:
                shutil.rmtree(root, ignore_errors=True)
        results = dict(out)

    print(
        f"Llama hidden={args.hidden} layers={args.layers} vocab={args.vocab} ({results['params'] / 1e6:.1f}M "
        f"params, fp32, AdamW), median of {args.repeats}, fsync in every save, "
        f"loads {'from the page cache' if args.warm else 'after evicting the files from the page cache'}"
    )
    print(f"{'world':<16}{'GB':>7}  {'op':<6}{'nanolight GB/s':>16}{'raw GB/s':>10}{'nanolight/raw':>15}")
    for world in args.worlds:
        r = results[world]
        name = "1 (1x1x1)" if world == 1 else f"2 ({args.layout})"
        for op in ("save", "load"):
            nl, raw = r[f"nanolight-{op}"], r[f"raw-{op}"]
            print(
                f"{name:<16}{r['bytes'] / 1e9:7.3f}  {op:<6}{r['bytes'] / nl / 1e9:16.2f}"
                f"{r['bytes'] / raw / 1e9:10.2f}{raw / nl:15.2f}"
            )


if __name__ == "__main__":
    main()
