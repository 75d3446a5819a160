"""`python recipes/smollm.py` end to end on smollm-tiny (CPU): the run directory, a falling
loss, and `checkpoint.resume=last` continuing with the uninterrupted run's losses."""

from __future__ import annotations

import csv
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from _dist import IMPORT_REPORT, NOT_IMPORTED_BY_A_RUN, imported, pythonpath
from hydra import compose, initialize_config_dir

from nanolight import load_pretrained
from nanolight.pretrain import load_config
from nanolight.pretrain.run import build_data

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("nanolight-cache")


# a tiny, fast run of the recipe (smollm-tiny on 2 MB of the embedded corpus)
BASE_OVERRIDES = (
    "data.embedded_max_mb=2",
    "data.tokenizer_train_mb=1",
    "trainer.micro_batch_size=4",
    "trainer.seq_len=64",
    "trainer.log_every_n_steps=1",
    "trainer.val_check_interval=6",
    "trainer.limit_val_batches=2",
    "optim.warmup_steps=2",
    "logger.offline=true",
)


def recipe(
    run_dir: Path, cache: Path, *overrides: str, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        str(REPO / "recipes" / "smollm.py"),
        f"trainer.default_root_dir={run_dir}",
        f"data.cache_dir={cache}",
        *BASE_OVERRIDES,
        *overrides,
    ]
    # this checkout's code, whatever an editable install elsewhere points at
    env = {**os.environ, **(env or {}), "WANDB_SILENT": "true", "PYTHONPATH": pythonpath(REPO)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=run_dir.parent, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def losses(run_dir: Path) -> dict[int, float]:
    """train/loss by optimizer step (1, 2, ...): Lightning writes step k's training row at k - 1."""
    with open(run_dir / "metrics.csv") as f:
        return {int(r["step"]) + 1: float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")}


def test_recipe_runs_and_resumes_exactly(tmp_path: Path, cache_dir: Path) -> None:
    full = tmp_path / "full"
    recipe(full, cache_dir, "trainer.max_steps=12", "checkpoint.every_n_steps=6")

    # the run directory holds what DESIGN.md promises
    assert (full / "config.yaml").is_file() and (full / "metrics.csv").is_file()
    assert (full / "checkpoints" / "last").read_text().strip() == "step-12"
    assert (full / "checkpoints" / "step-6" / "index.json").is_file()
    assert list((full / "wandb").glob("offline-run-*/run-*.wandb")), "no offline wandb run written"
    ref = losses(full)
    assert sorted(ref) == list(range(1, 13))
    assert ref[12] < ref[1] - 1.0, ref  # clearly learning (ln(8192) ~ 9 at init)
    with open(full / "metrics.csv") as f:
        assert any(r.get("val/loss") for r in csv.DictReader(f))

    # the run's `last` converts to a transformers model with the trained model's logits
    convert = [sys.executable, str(REPO / "scripts" / "convert_nanolight_to_hf.py")]
    last, hf_dir = full / "checkpoints" / "last", tmp_path / "hf"
    args = [*convert, "--checkpoint-path", str(last), "--save-path", str(hf_dir)]
    done = subprocess.run(args, capture_output=True, env={**os.environ, "PYTHONPATH": pythonpath(REPO)})
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    ids = torch.randint(0, 8192, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = load_pretrained(full / "checkpoints" / "step-12")(ids)
        theirs = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)

    # resume: a second run directory holding only the step-6 checkpoint continues from it
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / "step-6", resumed / "checkpoints" / "step-6")
    (resumed / "checkpoints" / "last").write_text("step-6\n")
    again = ("trainer.max_steps=12", "checkpoint.every_n_steps=6", "checkpoint.resume=last")
    recipe(resumed, cache_dir, *again)
    got = losses(resumed)
    assert sorted(got) == list(range(7, 13))
    for step, value in got.items():
        assert value == pytest.approx(ref[step], rel=1e-6, abs=0), (step, value, ref[step])

    # resuming the run that reached max_steps: one line saying so, exit 0, and no 'directory
    # exists and is not empty' warning (that is for a fresh run)
    finished = recipe(resumed, cache_dir, *again)
    assert "already reached trainer.max_steps=12 (step 12)" in finished.stdout, finished.stdout
    assert "exists and is not empty" not in finished.stdout + finished.stderr


def test_accumulation_logs_one_line_and_one_row_per_logged_step(tmp_path: Path, cache_dir: Path) -> None:
    """accumulate_grad_batches=2: one plain line per logged optimizer step (never at a micro-batch),
    and metrics.csv one row per logged step holding all of its metrics (lr, throughput, loss, val)."""
    run_dir = tmp_path / "run"
    proc = recipe(
        run_dir,
        cache_dir,
        "logger=csv",
        "trainer.max_steps=4",
        "trainer.accumulate_grad_batches=2",
        "trainer.log_every_n_steps=2",
        "trainer.val_check_interval=4",
    )
    lines = [ln.split()[1] for ln in proc.stdout.splitlines() if ln.startswith("step ") and " loss " in ln]
    assert lines == ["2/4", "4/4"], proc.stdout
    with open(run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps), key=int), steps  # one row per step
    row = next(r for r in rows if r["step"] == "1")  # optimizer step 2 (logged at 1)
    for key in ("train/loss", "throughput/tokens_per_sec", "lr-AdamW/pg1", "val/loss", "epoch"):
        assert row[key], (key, row)


def test_a_run_imports_only_what_it_uses(tmp_path: Path, cache_dir: Path) -> None:
    """A training process pays for each import at its start (a 1,000-rank job on a shared
    filesystem, every rank): the tokenizer's library where the tokenizer loads, never the dry run's
    tools, wandb under logger=csv, or hub datasets once the corpus is prepared (preparing it reads
    it with them)."""
    overrides = [*BASE_OVERRIDES, f"data.cache_dir={cache_dir}", "logger=csv"]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        build_data(load_config(compose(config_name="config", overrides=overrides)))  # prepared, here
    proc = recipe(tmp_path / "run", cache_dir, "logger=csv", "trainer.max_steps=2", env=IMPORT_REPORT)
    assert {"transformers", "tokenizers"} <= set(imported(proc.stderr, "transformers", "tokenizers"))
    assert imported(proc.stderr, *NOT_IMPORTED_BY_A_RUN) == []


def _offline_run_ids(run_dir: Path) -> list[str]:
    """The run id of every offline wandb run written there (each holds its run-<id>.wandb)."""
    return [
        p.stem.removeprefix("run-") for p in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    ]


def _shell(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """`command` as a user pastes it into a shell: `python` is this interpreter."""
    env = {
        **os.environ,
        "WANDB_SILENT": "true",
        "PYTHONPATH": pythonpath(REPO),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    }
    proc = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=300, cwd=cwd, env=env)
    assert proc.returncode == 0, command + "\n" + proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_a_run_starts_from_a_validation_and_ends_with_a_summary_whose_commands_work(
    tmp_path: Path, cache_dir: Path
) -> None:
    """The first thing a run measures is the untrained model (validation before step 1, logged at
    step 0), the last one the final model (a validation after the last step, here off the
    every-3-steps schedule); then a summary block whose next commands work as pasted: the resume
    continues the same wandb run and the epoch column, and the load command loads the run."""
    run_dir = tmp_path / "run"
    proc = recipe(run_dir, cache_dir, "trainer.max_steps=4", "trainer.val_check_interval=3")
    out = proc.stdout.splitlines()
    first_val = next(i for i, ln in enumerate(out) if ln.startswith("step 0  val/loss "))
    assert first_val < next(i for i, ln in enumerate(out) if ln.startswith("step 1/4")), proc.stdout
    with open(run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    vals = {int(r["step"]): float(r["val/loss"]) for r in rows if r.get("val/loss")}
    # before step 1 (step 0), after step 3 and after the last, step 4 (Lightning's step: 2 and 3)
    assert sorted(vals) == [0, 2, 3], vals
    assert abs(vals[0] - math.log(8192)) < 0.5, vals  # untrained: about ln(vocab)
    assert next(r for r in rows if r["step"] == "0")["val/bits_per_byte"]
    assert not any("val/" in ln for ln in out if ln.startswith("step ") and "/4 " in ln)  # never stale

    block = proc.stdout[proc.stdout.index("nanolight: run done:") :]
    assert "4 steps of 4" in block and f"val loss {vals[3]:.4f} (step 4)" in block, block
    assert "bits per byte of held-out text (gzip -9 " in block and "-> step-4" in block, block
    assert str(run_dir / "wandb" / "offline-run-") in block, block
    commands = {ln.split(":", 1)[0].strip(): ln.split(":", 1)[1].strip() for ln in block.splitlines()[-3:]}
    assert sorted(commands) == ["continue", "export", "load"], block

    loaded = _shell(commands["load"], tmp_path)
    assert "vocab_size=8192" in loaded.stdout, loaded.stdout
    resumed = _shell(commands["continue"], tmp_path)
    assert "exists and is not empty" not in resumed.stdout + resumed.stderr
    assert "steps 5-8 of 8" in resumed.stdout, resumed.stdout
    ids = _offline_run_ids(run_dir)
    assert len(ids) == 2 and ids[0] == ids[1], ids  # one wandb run, continued
    with open(run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows if r.get("train/loss")] == list(range(8))
    assert {r["epoch"] for r in rows} == {"0"}  # one epoch throughout, resumed or not
