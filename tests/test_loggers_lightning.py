"""CSVLogger and LearningRateMonitor against what Lightning 2.6 recorded (tests/fixtures/lightning):
the same rows written through nanolight's logger must read back as the fixture's files, and the
monitor driven through the stand-in trainer must produce the fixture's lr rows."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import yaml
from _lightning_standin import StandInTrainer, fixture, read_csv_logs, run_epochs

from nanolight.callbacks import LearningRateMonitor
from nanolight.errors import UsageError
from nanolight.loggers import CSVLogger
from nanolight.module.optimizers import SchedulerConfig


def _write(logger: CSVLogger, rows: list[dict[str, float]]) -> None:
    for row in rows:
        metrics = {k: v for k, v in row.items() if k != "step"}
        logger.log_metrics(metrics, step=int(row["step"]))
    logger.finalize("success")


@pytest.mark.parametrize(
    "program", ["classifier", "flags_plateau", "gan_manual", "hook_order", "regression_resume"]
)
def test_csv_files_read_back_as_lightning_wrote_them(tmp_path: Path, program: str) -> None:
    fx = fixture(program)
    for rel, rows in fx["csv"].items():
        save_dir = tmp_path / rel.split("/lightning_logs/")[0] if "/lightning_logs/" in rel else tmp_path
        # small flush interval: the header widens (and the file is rewritten) mid-run
        logger = CSVLogger(save_dir=save_dir, name="lightning_logs", flush_logs_every_n_steps=3)
        hparams = fx["hparams_yaml"].get(rel.replace("metrics.csv", "hparams.yaml"))
        if hparams is not None:
            logger.log_hyperparams(hparams)
        _write(logger, rows)
        assert Path(logger.log_dir) == (tmp_path / rel).parent
    csv_rows, headers = read_csv_logs(tmp_path)
    assert csv_rows == fx["csv"] and headers == fx["csv_columns"]
    hparams = {
        p.relative_to(tmp_path).as_posix(): yaml.safe_load(p.read_text())
        for p in tmp_path.rglob("hparams.yaml")
    }
    assert hparams == fx["hparams_yaml"]


def test_versions_names_and_prefix(tmp_path: Path) -> None:
    first, second = CSVLogger(tmp_path), CSVLogger(tmp_path)
    first.log_metrics({"a": 1.0}, step=0)
    first.save()
    assert (first.version, second.version) == (0, 1)  # a fresh version per run
    assert second.log_dir == os.path.join(tmp_path, "lightning_logs", "version_1")
    assert CSVLogger(tmp_path, version=7).log_dir == os.path.join(tmp_path, "lightning_logs", "version_7")
    assert CSVLogger(tmp_path, name="", version="run").log_dir == os.path.join(tmp_path, "run")
    fixed = CSVLogger(tmp_path, name="", version="")
    assert (fixed.log_dir, fixed.root_dir, fixed.save_dir) == (str(tmp_path),) * 3
    pre = CSVLogger(tmp_path / "p", prefix="train")
    pre.log_metrics({"loss": torch.tensor(0.5)})  # step None: the row count; tensors become floats
    pre.save()
    assert read_csv_logs(tmp_path / "p")[0] == {
        "lightning_logs/version_0/metrics.csv": [{"step": 0.0, "train-loss": 0.5}]
    }


def test_fixed_directory_continues_and_drops_rows_after_the_resume_step(tmp_path: Path) -> None:
    lg = CSVLogger(save_dir=tmp_path, name="", version="")
    for s in (1, 2, 3):
        lg.log_metrics({"a": float(s)}, s)
    lg.log_metrics({"lr-AdamW": 0.1}, 3)  # rows are not merged
    lg.save()
    again = CSVLogger(save_dir=tmp_path, name="", version="")
    again.log_metrics({"a": 20.0, "b": 1.0}, 2)  # resumed after step 1
    again.save()
    rows, headers = read_csv_logs(tmp_path)
    assert rows == {"metrics.csv": [{"a": 1.0, "step": 1.0}, {"a": 20.0, "b": 1.0, "step": 2.0}]}
    assert headers == {"metrics.csv": ["a", "b", "step"]}
    fresh = CSVLogger(save_dir=tmp_path / "v")  # Lightning's default: a reused version starts over
    fresh.log_metrics({"x": 1.0}, 0)
    fresh.save()
    reused = CSVLogger(save_dir=tmp_path / "v", version=0)
    reused.log_metrics({"y": 2.0}, 5)
    reused.save()
    assert read_csv_logs(tmp_path / "v")[0]["lightning_logs/version_0/metrics.csv"][0] == {
        "x": 1.0,
        "step": 0.0,
    }


def _lr_rows(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    return [r for r in rows if any(k.startswith("lr-") for k in r)]


def _monitor_run(tmp_path: Path, monitor: LearningRateMonitor, optimizers, configs, **kw) -> list[dict]:
    logger = CSVLogger(tmp_path, name="lightning_logs")
    trainer = StandInTrainer(
        tmp_path, callbacks=[monitor], loggers=[logger], optimizers=optimizers, lr_scheduler_configs=configs
    )
    run_epochs(trainer, **kw)
    logger.finalize("success")
    return trainer, next(iter(read_csv_logs(tmp_path)[0].values()))


def _approx_rows(rows: list[dict[str, float]]) -> list[object]:
    """Rows compared one flat dict at a time: pytest >= 9 refuses approx() of nested structures, and
    a list of per-row approx() keeps the same check (same length, same keys, each value rel 1e-6)."""
    return [pytest.approx(row) for row in rows]


class LogEvery(LearningRateMonitor):
    """Sets the stand-in's `should_log` as Lightning's log_every_n_steps does, then monitors."""

    def __init__(self, every: int, on_batch_end=None, **kw) -> None:
        super().__init__(**kw)
        self.every, self.on_batch_end = every, on_batch_end

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        trainer.should_log = (trainer.log_step + 1) % self.every == 0 or trainer.should_stop
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.on_batch_end:
            self.on_batch_end(trainer, batch_idx)


def test_lr_monitor_classifier_without_scheduler(tmp_path: Path) -> None:
    fx = fixture("classifier")
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=0.01)
    trainer, rows = _monitor_run(tmp_path, LogEvery(2), [opt], [], epochs=8, batches=6)
    want = _lr_rows(fx["csv"]["lightning_logs/version_0/metrics.csv"])
    assert rows == want  # epoch starts (0, 6, ...) and logging steps (1, 3, 5, ...)
    assert float(trainer.callback_metrics["lr-Adam"]) == fx["after_fit"]["callback_metrics"]["lr-Adam"]
    assert trainer.callback_metrics["lr-Adam"].dtype == torch.float32 and trainer.logged_metrics == {}


def test_lr_monitor_gan_scheduled_optimizer_first(tmp_path: Path) -> None:
    fx = fixture("gan_manual")
    opt_g = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=0.01, betas=(0.5, 0.9))
    opt_d = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=0.02, betas=(0.5, 0.9))
    sched = torch.optim.lr_scheduler.StepLR(opt_d, step_size=1, gamma=0.8)
    hand_steps = lambda trainer, batch_idx: (opt_d.step(), sched.step()) if batch_idx % 2 else None  # noqa: E731
    monitor = LogEvery(1, on_batch_end=hand_steps)
    _, rows = _monitor_run(tmp_path, monitor, [opt_g, opt_d], [SchedulerConfig(sched)], epochs=3, batches=4)
    assert rows == _approx_rows(_lr_rows(fx["csv"]["lightning_logs/version_0/metrics.csv"]))
    assert list(monitor.lrs) == ["lr-Adam", "lr-Adam-1"]


def test_lr_monitor_per_group_step_scheduler_every_micro_batch(tmp_path: Path) -> None:
    fx = fixture("regression_resume")
    w, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW(
        [{"params": [w], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}], lr=0.05
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    step_after_update = lambda trainer, batch_idx: (opt.step(), sched.step()) if batch_idx % 2 else None  # noqa: E731
    monitor = LogEvery(1, on_batch_end=step_after_update, log_weight_decay=True)
    _, rows = _monitor_run(
        tmp_path,
        monitor,
        [opt],
        [SchedulerConfig(sched, interval="step")],
        epochs=2,
        batches=12,
        accumulate=2,
    )
    want = _lr_rows(fx["csv"]["full/lightning_logs/version_0/metrics.csv"])[:24]
    assert [{k: v for k, v in r.items() if "weight_decay" not in k} for r in rows] == _approx_rows(want)
    assert rows[0]["lr-AdamW/pg1-weight_decay"] == 0.1 and rows[0]["lr-AdamW/pg2-weight_decay"] == 0.0


def test_lr_monitor_epoch_interval_with_momentum(tmp_path: Path) -> None:
    fx = fixture("flags_plateau")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.2, momentum=0.9)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)

    def halve_after_epoch_3(trainer, batch_idx):  # what the plateau scheduler did in the recorded run
        if trainer.current_epoch == 3 and batch_idx == 7:
            opt.param_groups[0]["lr"] = 0.1

    monitor = LogEvery(3, on_batch_end=halve_after_epoch_3, logging_interval="epoch", log_momentum=True)
    _, rows = _monitor_run(tmp_path, monitor, [opt], [SchedulerConfig(plateau)], epochs=6, batches=8)
    assert rows == _approx_rows(_lr_rows(fx["csv"]["lightning_logs/version_0/metrics.csv"]))


def test_lr_monitor_names_and_errors(tmp_path: Path) -> None:
    p = [torch.nn.Parameter(torch.zeros(1)) for _ in range(4)]
    named = torch.optim.SGD([{"params": [p[0]], "name": "enc"}, {"params": [p[1]], "name": "dec"}], lr=0.1)
    single = torch.optim.SGD([{"params": [p[2]], "name": "head"}], lr=0.2)
    plain = torch.optim.RMSprop([p[3]], lr=0.3)
    sched = torch.optim.lr_scheduler.StepLR(plain, 1)
    t = StandInTrainer(
        tmp_path,
        optimizers=[named, single, plain],
        lr_scheduler_configs=[SchedulerConfig(sched, name="my-lr")],
    )
    assert [names for _, names, _ in LearningRateMonitor()._named(t)] == [
        ["my-lr"],
        ["lr-SGD/enc", "lr-SGD/dec"],
        ["lr-SGD-1/head"],
    ]
    with pytest.raises(UsageError, match="has no logger"):
        LearningRateMonitor().on_train_start(t, None)
    dup = torch.optim.SGD([{"params": [p[0]], "name": "x"}, {"params": [p[1]], "name": "x"}], lr=0.1)
    with pytest.raises(UsageError, match=r"duplicated parameter group names \['x'\]"):
        LearningRateMonitor()._named(StandInTrainer(tmp_path, optimizers=[dup]))
    with pytest.raises(UsageError, match="logging_interval"):
        LearningRateMonitor(logging_interval="batch")
