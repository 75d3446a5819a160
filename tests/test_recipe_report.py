"""The recipe's trainer (`build_trainer`) in one process: the validation before step 1 and after
the last step, and the summary a run ends with (`pretrain/report.py`). The commands it prints
are run as pasted in tests/test_recipe_e2e.py (slow)."""

from __future__ import annotations

import csv
import math
import time
from pathlib import Path

from _tiny import tiny_config, token_loader

from nanolight.pretrain.config import CheckpointConfig, LoggerConfig, OptimConfig, PretrainConfig, TrainConfig
from nanolight.pretrain.module import CausalLMPretrain, HeldOut
from nanolight.pretrain.report import RunReport
from nanolight.pretrain.run import build_trainer
from nanolight.strategies import SingleDeviceStrategy


def test_validations_at_both_edges_and_the_summary(tmp_path: Path, capsys) -> None:
    """5 steps validating every 2: before step 1 (the untrained model, ~ln(vocab)), after 2, 4
    and 5 (the last, off the schedule), each printed once; the summary states the last one."""
    config = PretrainConfig(
        model=tiny_config(),
        trainer=TrainConfig(
            max_steps=5, micro_batch_size=2, seq_len=16, default_root_dir=str(tmp_path), log_every_n_steps=2,
            val_check_interval=2, limit_val_batches=2, enable_progress_bar=True,
        ),
        optim=OptimConfig(warmup_steps=1),
        checkpoint=CheckpointConfig(every_n_steps=None),
        logger=LoggerConfig(csv=True, wandb=False),
    )  # fmt: skip
    t = config.trainer
    held_out = HeldOut(n_bytes=1000, n_tokens=500, gzip_bpb=2.5, xz_bpb=2.25)
    report = RunReport(tmp_path, ["trainer.max_steps=5", "seed=3"], time.monotonic(), held_out)
    trainer = build_trainer(config, SingleDeviceStrategy("cpu"), tmp_path, report)
    module = CausalLMPretrain(config.model, config.optim, t.seq_len, t.max_steps, bytes_per_token=2.0)
    trainer.fit(module, token_loader(16, targets=True), token_loader(4, seed=5, targets=True))

    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    vals = {int(r["step"]): float(r["val/loss"]) for r in rows if r.get("val/loss")}
    assert sorted(vals) == [0, 1, 3, 4], vals  # Lightning's steps: before 1, after 2, 4 and 5
    assert abs(vals[0] - math.log(128)) < 0.3, vals  # the untrained model: about ln(vocab)
    assert rows[-1]["train/loss"] and rows[-1]["step"] == "4"  # the last step is logged, off the schedule
    out = capsys.readouterr().out.splitlines()
    assert [ln.split()[1] for ln in out if "val/loss" in ln] == ["0", "2", "4", "5"], out
    assert [ln.split()[1] for ln in out if " loss " in ln] == ["2/5", "4/5", "5/5"], out

    summary = report.summary()
    assert summary is not None and "5 steps of 5, 160 tokens" in summary, summary
    assert f"val loss {vals[4]:.4f} (step 5)" in summary, summary
    assert "bits per byte of held-out text (gzip -9 2.500, xz -9 2.250)" in summary, summary
    assert f"checkpoint  {tmp_path / 'checkpoints' / 'last'} -> step-5" in summary, summary
    assert "seed=3 checkpoint.resume=last trainer.max_steps=10" in summary, summary  # max_steps replaced
    export = next(ln for ln in summary.splitlines() if ln.strip().startswith("export:"))
    assert Path(export.split()[2]).is_file(), export  # the converter, found from anywhere
