"""Run the recipe at every layout of the slow matrix and keep each run's metrics.csv, or compare
two such sets: the check that a refactor changed no number.

    python scripts/compare_metrics.py --out /tmp/before            # on the old checkout
    python scripts/compare_metrics.py --out /tmp/after --against /tmp/before

Every column is compared as written, except the ones that measure wall time or host memory
(they differ run to run): a row or value that differs is printed and the exit status is 1.
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

BASE = (
    "logger=csv",
    "data.embedded_max_mb=2",
    "data.tokenizer_train_mb=1",
    "trainer.micro_batch_size=4",
    "trainer.seq_len=64",
    "trainer.log_every_n_steps=1",
    "trainer.val_check_interval=3",
    "trainer.limit_val_batches=2",
    "optim.warmup_steps=2",
    "trainer.max_steps=6",
    "checkpoint.every_n_steps=3",
    "trainer.enable_progress_bar=false",
)

# the slow matrix's layouts (tests/test_planner_memory.py, tests/test_recipe_parallel.py, ...)
LAYOUTS: dict[str, tuple[str, ...]] = {
    "single": (),
    "single-docmask-acc2": ("data.document_mask=true", "trainer.accumulate_grad_batches=2"),
    "tp2": ("+parallel.tp=2",),
    "tp2-sp": ("+parallel.tp=2", "+parallel.sequence_parallel=true"),
    "tp2-full-ac": ("+parallel.tp=2", "trainer.activation_checkpointing=full"),
    "pp2-1f1b": ("+parallel.pp=2", "trainer.accumulate_grad_batches=4"),
    "pp2-afab": ("+parallel.pp=2", "+parallel.pp_schedule=afab", "trainer.accumulate_grad_batches=4"),
    "pp2-interleaved-selective": (
        "+parallel.pp=2",
        "+parallel.pp_schedule=interleaved_1f1b",
        "+parallel.pp_virtual=2",
        "trainer.accumulate_grad_batches=4",
        "trainer.activation_checkpointing=selective",
    ),
    "dp2-zero1": ("+parallel.dp=2", "+parallel.zero_stage=1"),
    "dp2-docmask": ("+parallel.dp=2", "data.document_mask=true", "trainer.accumulate_grad_batches=2"),
    "tp2-pp2-dp2": (
        "+parallel.tp=2",
        "+parallel.pp=2",
        "+parallel.dp=2",
        "trainer.accumulate_grad_batches=2",
    ),
}

VOLATILE = ("throughput", "time", "memory", "mfu")  # measured, not computed


def run_all(out: Path, only: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    cache = out / "cache"
    for name, overrides in LAYOUTS.items():
        if only and name not in only:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp) / name
            cmd = [
                sys.executable,
                str(REPO / "recipes" / "smollm.py"),
                f"trainer.default_root_dir={run_dir}",
                f"data.cache_dir={cache}",
                *BASE,
                *overrides,
            ]
            env = {**os.environ, "WANDB_SILENT": "true", "PYTHONPATH": str(REPO)}
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, env=env, timeout=1200)
            if proc.returncode != 0:
                sys.exit(f"{name}: the run failed:\n{proc.stderr[-3000:]}")
            shutil.copy(run_dir / "metrics.csv", out / f"{name}.csv")
            print(f"{name}: {out / f'{name}.csv'}", flush=True)


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return [
            {k: v for k, v in row.items() if not any(s in k for s in VOLATILE)} for row in csv.DictReader(f)
        ]


def compare(out: Path, against: Path) -> int:
    differences = 0
    for before in sorted(against.glob("*.csv")):
        after = out / before.name
        if not after.exists():
            print(f"{before.stem}: not run")
            continue
        old, new = _rows(before), _rows(after)
        if old == new:
            print(f"{before.stem}: identical ({len(old)} rows, columns {sorted(old[0])})")
            continue
        differences += 1
        print(f"{before.stem}: DIFFERS ({len(old)} rows before, {len(new)} after)")
        for i, (a, b) in enumerate(zip(old, new, strict=False)):
            if a != b:
                print(f"  row {i}: {sorted(set(a.items()) ^ set(b.items()))}")
    return 1 if differences else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where each layout's metrics.csv is written")
    parser.add_argument("--against", type=Path, help="a directory written before: compare with it")
    parser.add_argument("--only", nargs="*", default=[], help=f"a subset of {list(LAYOUTS)}")
    parser.add_argument("--compare-only", action="store_true", help="do not run, only compare")
    args = parser.parse_args()
    if not args.compare_only:
        run_all(args.out, args.only)
    if args.against:
        sys.exit(compare(args.out, args.against))


if __name__ == "__main__":
    main()
