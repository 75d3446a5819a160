"""CSVLogger and WandbLogger(offline) outputs, read back from disk."""

from __future__ import annotations

import csv
import json
import struct
import time
from pathlib import Path

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
    trainer = _fit(tmp_path, True)
    path = tmp_path / "metrics.csv"
    assert trainer.log_dir == str(tmp_path)
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
        header = rows[0].keys()
    assert {"step", "train/loss", "lr", "val/loss"} <= set(header)
    by_step = {int(r["step"]): r for r in rows}
    assert sorted(by_step) == [2, 3, 4, 6]  # logging steps 2, 4, 6; validation at 3 and 6
    assert by_step[3]["train/loss"] == "" and float(by_step[3]["val/loss"]) > 0
    # step 6: train metrics, lr and validation merged into one row
    assert by_step[6]["train/loss"] and by_step[6]["lr"] and by_step[6]["val/loss"]
    assert abs(float(by_step[6]["train/loss"]) - trainer.logged_metrics["train/loss"]) < 1e-7
    assert float(by_step[2]["lr"]) == 0.05 / (1 + 0.1 * 1)  # the lr step 2 used


def test_csv_logger_resume_drops_rows_after_new_start(tmp_path):
    lg = CSVLogger(save_dir=tmp_path)
    for s in (1, 2, 3):
        lg.log_metrics({"a": float(s)}, s)
    lg.save()
    again = CSVLogger(save_dir=tmp_path)
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
    assert sorted(history) == [2, 3, 4, 6]
    assert abs(history[6]["train/loss"] - trainer.logged_metrics["train/loss"]) < 1e-7
    assert "val/loss" in history[6] and "lr" in history[2]
