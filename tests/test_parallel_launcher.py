"""Launcher: environment detection, re-launch under plain python, and no hang when a rank dies."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from nanolight.parallel.environment import ProcessEnv, detect_environment, first_slurm_host, launched_rank
from nanolight.parallel.launcher import ensure_processes

REPO_ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from nanolight.parallel.launcher import ensure_processes, init_distributed

env = ensure_processes(2)  # the plain-python parent re-launches this file twice and exits here
init_distributed(env, backend="gloo", timeout=timedelta(seconds=120))
mode = sys.argv[1]
if mode == "die" and env.rank == 1:
    os._exit(3)  # rank 1 crashes without a word; rank 0 is about to block in all_reduce
x = torch.tensor([float(env.rank + 1)])
dist.all_reduce(x)  # ranks 0 and 1 exchange their numbers: 1 + 2
assert x.item() == 3.0, x
open(os.path.join(sys.argv[2], f"rank{env.rank}.txt"), "w").write(env.source)
dist.destroy_process_group()
"""


def _run_script(tmp_path: Path, mode: str, timeout: float = 90) -> tuple[subprocess.CompletedProcess, float]:
    script = tmp_path / "tiny.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID")
    }
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(script), mode, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, time.monotonic() - start


def test_plain_python_relaunches_two_ranks(tmp_path: Path) -> None:
    proc, _ = _run_script(tmp_path, "ok")
    assert proc.returncode == 0, proc.stderr
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}.txt").read_text() == "subprocess"


def test_dead_rank_fails_fast_with_nonzero_exit(tmp_path: Path) -> None:
    # The process-group timeout is 120 s: only the launcher stopping rank 0 can make this quick.
    proc, elapsed = _run_script(tmp_path, "die")
    assert proc.returncode != 0
    assert re.search(r"rank 1 \(pid \d+\) exited with 3", proc.stderr), proc.stderr
    assert elapsed < 45, f"took {elapsed:.1f}s: the surviving rank was not stopped"
    assert not (tmp_path / "rank0.txt").exists()


def test_detect_torchrun_environment() -> None:
    env = detect_environment(
        {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "node7", "MASTER_PORT": "29400"}
    )
    assert env == ProcessEnv(3, 4, 1, "node7", 29400, "torchrun")


def test_detect_slurm_environment() -> None:
    env = detect_environment(
        {
            "SLURM_PROCID": "5",
            "SLURM_NTASKS": "8",
            "SLURM_LOCALID": "1",
            "SLURM_NODELIST": "gpu[003-006,009]",
            "SLURM_JOB_ID": "123456",
        }
    )
    assert env is not None and env.source == "slurm"
    assert (env.rank, env.world_size, env.local_rank) == (5, 8, 1)
    assert env.master_port == 15000 + 123456 % 20000
    assert env.master_addr == "gpu003" or shutil.which("scontrol")  # scontrol, when present, decides


def test_detect_nothing_under_plain_python_or_batch_shell() -> None:
    assert detect_environment({}) is None
    assert detect_environment({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) is None


def test_launched_rank_before_any_strategy() -> None:
    """What ``import nanolight`` gives rank-zero printing: torchrun's rank, else srun's, else 0."""
    assert launched_rank({"RANK": "3", "SLURM_PROCID": "5"}) == 3
    assert launched_rank({"SLURM_PROCID": "5", "SLURM_NTASKS": "8"}) == 5
    assert launched_rank({}) == 0


def test_import_nanolight_sets_the_rank_zero_rank_without_torch() -> None:
    """``import nanolight`` stays light (no torch, no process groups) and knows the launched rank."""
    code = "import sys, nanolight\nfrom lightning_utilities.core.rank_zero import rank_zero_only\n"
    code += "print(rank_zero_only.rank, 'torch' in sys.modules)"
    env = {**os.environ, "RANK": "2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["2", "False"]


@pytest.mark.parametrize(
    ("nodelist", "host"), [("gpu[003-005,009]", "gpu003"), ("node1,node2", "node1"), ("a-b[7]", "a-b7")]
)
def test_first_slurm_host_parses_compressed_lists(
    nodelist: str, host: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("shutil.which", lambda name: None)  # no scontrol: use the parser
    assert first_slurm_host(nodelist) == host


def test_world_size_mismatch_names_the_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {
        "RANK": "0",
        "WORLD_SIZE": "3",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
    }.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=r"started 3 processes .* needs tp\*pp\*dp = 4"):
        ensure_processes(4)


TRAIN_SCRIPT = """
import json, sys
import torch
from torch.utils.data import DataLoader
from nanolight import NanoModule, NanoTrainer
from nanolight.models import LlamaConfig, LlamaForCausalLM
from nanolight.strategies.parallel3d import Parallel3DStrategy

class LM(NanoModule):
    def configure_model(self):
        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, max_position_embeddings=32, tie_word_embeddings=True)
        self.model = LlamaForCausalLM(cfg)
        self.losses = []
    def training_step(self, batch, i):
        loss = self.model(batch["input_ids"], labels=batch["labels"])
        self.losses.append(loss.item())
        return loss
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

ids = torch.randint(0, 64, (6, 8), generator=torch.Generator().manual_seed(0))
loader = DataLoader([{"input_ids": x, "labels": x} for x in ids], batch_size=2)
trainer = NanoTrainer(use_distributed_sampler=False, max_steps=3, strategy=Parallel3DStrategy(tp=2), seed=0, logger=False,
                      enable_progress_bar=False, enable_checkpointing=False, default_root_dir=sys.argv[1])
module = LM()
trainer.fit(module, train_dataloaders=loader)
if trainer.is_global_zero:
    json.dump({"world": trainer.world_size, "losses": module.losses}, open(sys.argv[1] + "/out.json", "w"))
"""


@pytest.mark.slow
def test_trainer_under_plain_python_relaunches_tp2(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAIN_SCRIPT))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    out = json.loads((tmp_path / "out.json").read_text())
    assert out["world"] == 2 and len(out["losses"]) == 3
