"""ModelCheckpoint and EarlyStopping against what Lightning 2.6 recorded (tests/fixtures/lightning),
driven through a stand-in trainer that has only the agreed trainer interface."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from _lightning_standin import StandInTrainer, fixture, listing, run_epochs, stem

from nanolight.callbacks import EarlyStopping, ModelCheckpoint
from nanolight.callbacks.checkpoint_paths import format_name
from nanolight.errors import UsageError
from nanolight.loggers import CSVLogger


def _fit_val_losses(name: str) -> list[float]:
    """The fit-time validation values of a fixture's run, in order."""
    rows = next(iter(fixture(name)["csv"].values()))
    return [r["val_loss"] for r in rows if "val_loss" in r and "test_loss" not in r]


def test_classifier_top2_and_early_stopping_match_lightning(tmp_path: Path) -> None:
    fx = fixture("classifier")
    losses = _fit_val_losses("classifier")[:8]  # the 9th row is validate() after fit
    ckpt = ModelCheckpoint(monitor="val_loss", filename="{epoch}-{val_loss:.3f}", save_top_k=2)
    early = EarlyStopping(monitor="val_loss", patience=2, min_delta=0.005)
    logger = CSVLogger(save_dir=tmp_path, name="lightning_logs")
    trainer = StandInTrainer(tmp_path, callbacks=[early, ckpt], loggers=[logger], max_epochs=30)
    metrics = lambda epoch, _: {"val_loss": torch.tensor(losses[epoch])}  # noqa: E731
    run_epochs(trainer, 30, 6, validate_after=(6,), val_metrics=metrics)
    want = fx["checkpoints"][0]
    assert Path(ckpt.dirpath) == (tmp_path / want["dirpath"]).resolve()
    assert listing(ckpt.dirpath) == sorted([*want["files"], "last"])  # nanolight's pointer next to them
    assert {stem(k): float(v) for k, v in ckpt.best_k_models.items()} == want["best_k_models"]
    assert stem(ckpt.best_model_path) == want["best_model_path"]
    assert float(ckpt.best_model_score) == want["best_model_score"]
    assert stem(ckpt.last_model_path) == want["last_model_path"] is None  # save_last unset
    assert (
        stem(ckpt.kth_best_model_path) == "epoch=5-val_loss=0.686"
        and ckpt.kth_value == ckpt.best_k_models[ckpt.kth_best_model_path]
    )
    es = fx["after_fit"]["early_stopping"]
    assert (early.stopped_epoch, early.wait_count) == (es["stopped_epoch"], es["wait_count"])
    assert float(early.best_score) == es["best_score"]
    assert trainer.current_epoch == fx["after_fit"]["current_epoch"] and trainer.should_stop
    assert "did not improve in the last 2 records" in early.stopping_reason_message
    assert early.stopping_reason.name == "PATIENCE_EXHAUSTED"


def _regression_run(tmp_path: Path, max_steps: int, ckpt_dir: Path, resume: str | None = None):
    ckpt = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=4, save_last=True)
    trainer = StandInTrainer(
        tmp_path, callbacks=[ckpt], max_steps=max_steps, val_check_interval=4, num_training_batches=12
    )
    if resume:
        trainer.restore_callbacks(resume)
        trainer.current_epoch = trainer.global_step // 6
    val = lambda epoch, i: {"val_loss": torch.tensor(1.0 / (epoch * 3 + i + 1))}  # noqa: E731
    run_epochs(trainer, 10, 12, accumulate=2, validate_after=(4, 8, 12), val_metrics=val)
    return ckpt, trainer


def test_regression_resume_every_n_steps_save_last_matches_lightning(tmp_path: Path) -> None:
    fx = fixture("regression_resume")
    for run, steps in (("full", 24), ("half", 12)):
        ckpt, trainer = _regression_run(tmp_path, steps, tmp_path / run / "checkpoints")
        want = fx[run]["checkpoints"][0]
        assert listing(ckpt.dirpath) == want["files"]  # Lightning's last.ckpt <-> nanolight's pointer
        assert stem(ckpt.best_model_path) == want["best_model_path"] and ckpt.best_model_score is None
        assert stem(ckpt.last_model_path) == want["last_model_path"] and ckpt.best_k_models == {}
        assert trainer.saves == [f"epoch={(s - 1) // 6}-step={s}" for s in range(4, steps + 1, 4)]
    half = tmp_path / "half" / "checkpoints"
    with pytest.warns(UserWarning, match="exists and is not empty"):  # as Lightning, on a resume
        ckpt, trainer = _regression_run(tmp_path, 24, half, resume=str(half / "epoch=1-step=12"))
    want = fx["resumed"]["checkpoints"][0]
    assert listing(half) == want["files"] and stem(ckpt.best_model_path) == want["best_model_path"]
    assert trainer.saves == ["epoch=2-step=16", "epoch=3-step=20", "epoch=3-step=24"]
    assert (half / "last").read_text().strip() == "epoch=3-step=24"


def test_default_checkpoint_goes_under_the_logger_version(tmp_path: Path) -> None:
    fx = fixture("hook_order")["checkpoints"][0]  # the default ModelCheckpoint, 2 epochs x 2 steps
    ckpt = ModelCheckpoint()
    trainer = StandInTrainer(tmp_path, callbacks=[ckpt], loggers=[CSVLogger(tmp_path)])
    val = lambda epoch, i: {"val_loss": torch.tensor(float(epoch))}  # noqa: E731
    run_epochs(trainer, 2, 4, accumulate=2, validate_after=(4,), val_metrics=val)
    assert Path(ckpt.dirpath) == (tmp_path / fx["dirpath"]).resolve()
    assert listing(ckpt.dirpath) == sorted([*fx["files"], "last"])
    assert stem(ckpt.best_model_path) == fx["best_model_path"] and ckpt.best_k_models == {}
    bare = ModelCheckpoint()
    bare.setup(StandInTrainer(tmp_path / "x"), None, "validate")
    assert bare.dirpath == str(tmp_path / "x" / "checkpoints")


@pytest.mark.parametrize(
    ("template", "metrics", "auto", "ver", "name"),
    [
        ("{epoch}-{val_loss:.3f}", {"epoch": 6, "val_loss": torch.tensor(0.68196)}, True, None, "epoch=6-val_loss=0.682"),
        (None, {"epoch": torch.tensor(1), "step": torch.tensor(12)}, True, None, "epoch=1-step=12"),
        ("{epoch:03d}", {"epoch": 5}, True, None, "epoch=005"),
        ("epoch={epoch}-validation_loss={val_loss:.2f}", {"epoch": 2, "val_loss": 0.123456}, False, None, "epoch=2-validation_loss=0.12"),
        ("{missing:d}", {}, True, None, "missing=0"),
        ("step-{step}", {"step": torch.tensor(40)}, False, None, "step-40"),
        ("{epoch}-{epoch_test}", {"epoch": 1, "epoch_test": 2}, True, 1, "epoch=1-epoch_test=2-v1"),
        ("{val.acc:.1f}", {"val.acc": 0.25}, True, None, "val.acc=0.2"),
    ],
)  # fmt: skip
def test_checkpoint_names(template, metrics, auto, ver, name) -> None:
    assert format_name(template, metrics, auto, version=ver) == name


def test_slash_in_a_metric_name_is_flattened_with_a_warning() -> None:
    with pytest.warns(UserWarning, match=r"'val/loss=0\.50'.*saving it as 'val_loss=0\.50'"):
        assert format_name("{val/loss:.2f}", {"val/loss": 0.5}) == "val_loss=0.50"


def test_version_counter_and_missing_monitor_after_validation(tmp_path: Path) -> None:
    (tmp_path / "ck" / "epoch=0-step=2").mkdir(parents=True)  # another run's
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=2, save_top_k=-1)
    trainer = StandInTrainer(tmp_path, callbacks=[ckpt])
    with pytest.warns(UserWarning, match="exists and is not empty"):
        run_epochs(trainer, 1, 4)
    assert trainer.saves == ["epoch=0-step=2-v1", "epoch=0-step=4"]
    assert "epoch=0-step=2" in listing(tmp_path / "ck")  # not this callback's: never removed
    watch = ModelCheckpoint(dirpath=tmp_path / "m", monitor="val_acc")
    trainer = StandInTrainer(tmp_path, callbacks=[watch])
    with pytest.warns(UserWarning, match="could not find the monitored key"):
        run_epochs(trainer, 1, 2)  # no validation ran yet: a warning, nothing saved
    assert trainer.saves == [] and not (tmp_path / "m").exists()
    with pytest.raises(
        UsageError, match=r"monitor='val_acc'.*\['val_loss', 'epoch', 'step'\].*log\('val_acc'"
    ):
        run_epochs(
            trainer, 1, 2, validate_after=(2,), val_metrics=lambda e, i: {"val_loss": torch.tensor(1.0)}
        )


def test_save_on_exception_saves_the_step_the_exception_stopped(tmp_path: Path) -> None:
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_on_exception=True)
    trainer = StandInTrainer(tmp_path, callbacks=[ckpt])
    ckpt.setup(trainer, None, "fit")
    trainer.call("on_train_start")
    trainer.global_step = 3
    ckpt.on_exception(trainer, None, RuntimeError("boom"))
    assert trainer.saves == ["epoch=0-step=3"]
    assert (tmp_path / "last").read_text().strip() == "epoch=0-step=3"


def test_save_last_keeps_newest_and_keep_last_n_adds_to_top_k(tmp_path: Path) -> None:
    ckpt = ModelCheckpoint(
        dirpath=tmp_path, monitor="loss", every_n_train_steps=1, save_top_k=1, save_last=True, keep_last_n=2
    )
    trainer = StandInTrainer(tmp_path, callbacks=[ckpt], num_val_batches=[0], num_training_batches=100)
    values = iter([3.0, 1.0, 2.0, 4.0, 5.0, 0.5])
    orig = ckpt.on_train_batch_end

    def with_loss(tr, module, *args):  # the metric the step logged
        tr.callback_metrics["loss"] = torch.tensor(next(values))
        orig(tr, module, *args)

    ckpt.on_train_batch_end = with_loss
    run_epochs(trainer, 1, 5)
    # top-1: step 2 (1.0); steps 3-5 are not top-1 but save_last saves them; keep_last_n=2 keeps 4, 5
    assert trainer.saves == [
        "epoch=0-step=1",
        "epoch=0-step=2",
        "epoch=0-step=3",
        "epoch=0-step=4",
        "epoch=0-step=5",
    ]
    assert listing(tmp_path) == ["epoch=0-step=2", "epoch=0-step=4", "epoch=0-step=5", "last"]
    assert (tmp_path / "last").read_text().strip() == "epoch=0-step=5"
    assert stem(ckpt.best_model_path) == "epoch=0-step=2" and ckpt.last_model_path == str(tmp_path / "last")
    state = ckpt.state_dict()
    again = ModelCheckpoint(dirpath=tmp_path, monitor="loss", every_n_train_steps=1)
    again.load_state_dict(state)
    assert again.best_k_models == ckpt.best_k_models and again.best_model_path == ckpt.best_model_path
    moved = ModelCheckpoint(dirpath=tmp_path / "elsewhere", monitor="loss", every_n_train_steps=1)
    with pytest.warns(UserWarning, match="dirpath has changed"):
        moved.load_state_dict(state)
    assert moved.best_k_models == {} and moved.best_model_path == ckpt.best_model_path


def test_recipe_style_checkpoints_and_skips(tmp_path: Path) -> None:
    ckpt = ModelCheckpoint(
        dirpath=tmp_path, filename="step-{step}", auto_insert_metric_name=False, every_n_train_steps=3,
        save_top_k=1, keep_last_n=2, save_last=True, save_on_train_end=True,
    )  # fmt: skip
    trainer = StandInTrainer(tmp_path, callbacks=[ckpt], max_steps=10, num_training_batches=100)
    run_epochs(trainer, 1, 100)
    assert trainer.saves == ["step-3", "step-6", "step-9", "step-10"]  # the end is saved too
    assert listing(tmp_path) == ["last", "step-10", "step-9"]
    assert ckpt.save_now(trainer) == str(tmp_path / "step-10") and len(trainer.saves) == 4  # already saved
    trainer.global_step = 11  # e.g. preempted after step 11
    assert ckpt.save_now(trainer) == str(tmp_path / "step-11")
    assert listing(tmp_path) == ["last", "step-10", "step-11"] and ckpt.best_model_path.endswith("step-11")
    for flag in (
        {"sanity_checking": True},
        {"fast_dev_run": 1},
        {"state": type("S", (), {"fn": "validate"})},
    ):
        at_end = "sanity_checking" not in flag  # a sanity check never ends training
        other = ModelCheckpoint(dirpath=tmp_path / "skip", every_n_train_steps=1, save_on_train_end=at_end)
        t = StandInTrainer(tmp_path, callbacks=[other], **flag)
        run_epochs(t, 1, 2)
        assert t.saves == []


def test_triggers_and_epoch_end_resolution() -> None:
    assert (ModelCheckpoint().every_n_epochs, ModelCheckpoint(every_n_train_steps=5).every_n_epochs) == (1, 0)
    with pytest.raises(UsageError, match="mutually exclusive"):
        ModelCheckpoint(every_n_train_steps=2, every_n_epochs=1)
    with pytest.raises(UsageError, match="no quantity to rank"):
        ModelCheckpoint(save_top_k=3)
    ckpt = ModelCheckpoint()
    t = StandInTrainer(".")
    assert ckpt._should_save_on_train_epoch_end(t)
    for kw in ({"val_check_interval": 0.5}, {"check_val_every_n_epoch": 2}, {"val_check_interval": 4}):
        assert not ckpt._should_save_on_train_epoch_end(StandInTrainer(".", **kw))
    assert ckpt._should_save_on_train_epoch_end(
        StandInTrainer(".", val_check_interval=4, num_val_batches=[0])
    )
    assert ckpt.state_key == (
        "ModelCheckpoint{'monitor': None, 'mode': 'min', 'every_n_train_steps': 0, 'every_n_epochs': 1, "
        "'train_time_interval': None}"
    )
    assert EarlyStopping("a", mode="max").state_key == "EarlyStopping{'monitor': 'a', 'mode': 'max'}"


def test_flags_plateau_early_stopping_after_each_validation_matches_lightning(tmp_path: Path) -> None:
    fx = fixture("flags_plateau")
    losses = _fit_val_losses("flags_plateau")  # two validations in each of epochs 1, 3, 5
    early = EarlyStopping(monitor="val_loss", patience=1, min_delta=10)
    t = StandInTrainer(tmp_path, callbacks=[early], val_check_interval=0.5, check_val_every_n_epoch=2)
    early.setup(t, None, "fit")
    assert early._check_on_train_epoch_end is False  # validation is not once per epoch end
    t.sanity_checking = True
    t.callback_metrics["val_loss"] = torch.tensor(99.0)
    early.on_validation_end(t, None)  # skipped: sanity check
    t.sanity_checking = False
    for i, value in enumerate(losses):
        t.current_epoch = [1, 1, 3, 3, 5, 5][i]
        t.callback_metrics["val_loss"] = torch.tensor(value)
        early.on_validation_end(t, None)
        early.on_train_epoch_end(t, None)  # not checked here
        assert t.should_stop == (i >= 1)
    assert {"stopped_epoch": early.stopped_epoch, "wait_count": early.wait_count} == fx["early_stopping"]
    assert float(early.best_score) == pytest.approx(losses[0])


def test_early_stopping_thresholds_strict_and_state(tmp_path: Path) -> None:
    t = StandInTrainer(tmp_path)
    es = EarlyStopping(monitor="acc", mode="max", stopping_threshold=0.9)
    t.callback_metrics = {"acc": torch.tensor(0.95), "loss": torch.tensor(1.0)}
    es.on_validation_end(t, None)
    assert t.should_stop and es.stopping_reason.name == "STOPPING_THRESHOLD"
    with pytest.raises(RuntimeError, match="`nope` which is not available.*`acc`, `loss`"):
        EarlyStopping(monitor="nope").on_validation_end(t, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        EarlyStopping(monitor="nope", strict=False).on_validation_end(t, None)  # silently skipped
    div = EarlyStopping(monitor="loss", divergence_threshold=0.5)
    t.should_stop = False
    div.on_validation_end(t, None)
    assert t.should_stop and div.stopping_reason.name == "DIVERGENCE_THRESHOLD"
    nan = EarlyStopping(monitor="loss")
    t.callback_metrics["loss"] = torch.tensor(float("nan"))
    nan.on_validation_end(t, None)
    assert nan.stopping_reason.name == "NON_FINITE_METRIC"
    restored = EarlyStopping(monitor="loss")
    restored.load_state_dict(div.state_dict())
    assert restored.stopping_reason == div.stopping_reason and restored.wait_count == div.wait_count
