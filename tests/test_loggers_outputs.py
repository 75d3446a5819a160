"""CSVLogger and WandbLogger(offline) outputs, read back from disk."""

from __future__ import annotations

import csv
import json
import struct
import time
from pathlib import Path
from types import SimpleNamespace

from _trainer_helpers import MLPModule, loader, make_data

from nanolight.callbacks import LearningRateMonitor
from nanolight.loggers import CSVLogger, WandbLogger
from nanolight.trainer import NanoTrainer


def _fit(tmp_path, logger, steps=6, **kw) -> NanoTrainer:
    ds = make_data(32)
    trainer = NanoTrainer(
        max_steps=steps, log_every_n_steps=2, val_check_interval=3, limit_val_batches=2,
        callbacks=[LearningRateMonitor()], logger=logger, enable_progress_bar=False,
        enable_checkpointing=False, default_root_dir=tmp_path, **kw,
    )  # fmt: skip
    trainer.fit(MLPModule(scheduler=True), loader(ds, 4), loader(ds, 8))
    return trainer


def test_csv_logger_rows_and_late_columns(tmp_path):
    trainer = _fit(tmp_path, True)  # logger=True: CSVLogger(save_dir=default_root_dir), as Lightning
    log_dir = tmp_path / "lightning_logs" / "version_0"
    assert trainer.log_dir == str(log_dir)
    with open(log_dir / "metrics.csv", newline="") as f:
        reader = csv.DictReader(f)
        rows, header = list(reader), reader.fieldnames
    assert header == ["epoch", "lr-AdamW", "step", "train/loss", "val/loss"]  # sorted, as Lightning
    # one row per log call, never merged; `step` = optimizer steps done before the row's batch
    # (logging steps 2, 4, 6 -> rows at 1, 3, 5; validations after steps 3 and 6 -> rows at 2, 5);
    # LearningRateMonitor's rows come first (on_train_batch_start) and have no epoch
    shape = [(int(r["step"]), [k for k in header if r[k] and k not in ("step", "epoch")]) for r in rows]
    assert shape == [
        (1, ["lr-AdamW"]), (1, ["train/loss"]), (2, ["val/loss"]),
        (3, ["lr-AdamW"]), (3, ["train/loss"]),
        (5, ["lr-AdamW"]), (5, ["train/loss"]), (5, ["val/loss"]),
    ]  # fmt: skip
    assert all((r["epoch"] == "") == bool(r["lr-AdamW"]) for r in rows)
    assert abs(float(rows[6]["train/loss"]) - float(trainer.logged_metrics["train/loss"])) < 1e-7
    assert float(rows[0]["lr-AdamW"]) == 0.05 / (1 + 0.1 * 1)  # the lr step 2 used
    assert "lr-AdamW" in trainer.callback_metrics and "lr-AdamW" not in trainer.logged_metrics


def test_csv_logger_resume_drops_rows_after_new_start(tmp_path):
    lg = CSVLogger(save_dir=tmp_path, name="", version="")  # the recipe's fixed directory
    for s in (1, 2, 3):
        lg.log_metrics({"a": float(s)}, s)
    lg.save()
    again = CSVLogger(save_dir=tmp_path, name="", version="")
    again.log_metrics({"a": 20.0, "b": 1.0}, 2)  # resumed after step 1
    again.save()
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["step"], r["a"], r["b"]) for r in rows] == [("1", "1.0", ""), ("2", "20.0", "1.0")]


def _wandb_records(run_file: Path):
    """Minimal reader of a .wandb file (LevelDB-log framing of wandb's protobuf Records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if pos + 7 + length > len(data):  # the writer is mid-record: stop here
            break
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        buf = chunk if kind == 2 else buf + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def test_wandb_logger_offline_history(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    logger = WandbLogger(project="nanolight-test", name="tiny", save_dir=tmp_path)
    assert logger.mode == "offline"  # no credentials -> offline, no prompt
    trainer = _fit(tmp_path, logger)
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    # wandb's writer process may still be flushing after finish() returns: wait for the exit record
    deadline = time.monotonic() + 30
    records = _wandb_records(run_file)
    while not any(r.WhichOneof("record_type") == "exit" for r in records):
        assert time.monotonic() < deadline, "wandb never wrote its exit record"
        time.sleep(0.2)
        records = _wandb_records(run_file)
    history = {}
    for rec in records:
        if rec.WhichOneof("record_type") == "history":
            row = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in rec.history.item}
            history[row["_step"]] = row
    assert sorted(history) == [1, 2, 3, 5]  # wandb folds the rows of one step into one record
    assert abs(history[5]["train/loss"] - float(trainer.logged_metrics["train/loss"])) < 1e-7
    assert "val/loss" in history[5] and "lr-AdamW" in history[1]


def test_wandb_logger_reads_the_saved_directory_through_the_public_property(monkeypatch):
    """WandbLogger learns what ModelCheckpoint wrote from its public ``last_checkpoint_saved``."""
    uploaded = []
    logger = WandbLogger(project="nanolight-test", log_model="all")
    monkeypatch.setattr(logger, "_log_checkpoint", uploaded.append)
    logger.after_save_checkpoint(SimpleNamespace(last_checkpoint_saved="/ckpt/epoch=0-step=4"))
    assert uploaded == ["/ckpt/epoch=0-step=4"]


def test_recipe_resume_continues_the_wandb_run(tmp_path, monkeypatch):
    """The recipe's loggers: a resume in the same run directory logs into the wandb run the first
    run recorded (resume="allow" with its id), so the history is one run, not one per resume."""
    from nanolight.pretrain.config import CheckpointConfig, LoggerConfig, PretrainConfig
    from nanolight.pretrain.report import RunReport
    from nanolight.pretrain.run import build_loggers

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    ds = make_data(32)
    for resume in (None, "last"):
        config = PretrainConfig(checkpoint=CheckpointConfig(resume=resume), logger=LoggerConfig(csv=False))
        trainer = NanoTrainer(
            max_steps=2, logger=build_loggers(config, tmp_path), enable_progress_bar=False,
            callbacks=[RunReport(tmp_path, [], 0.0, None)], enable_checkpointing=False, default_root_dir=tmp_path,
        )  # fmt: skip
        trainer.fit(MLPModule(), loader(ds, 4))
    runs = sorted(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))  # one file per run: run-<run id>.wandb
    assert len(runs) == 2 and runs[0].name == runs[1].name, runs
