"""Built-in callbacks and precision modes on a tiny CPU model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from _trainer_helpers import MLPModule, loader, make_data
from torch import nn
from torch.utils.data import DataLoader

from nanolight.callbacks import (
    Callback,
    EarlyStopping,
    ModelCheckpoint,
    NaNGuard,
    RichProgressBar,
    ThroughputMonitor,
)
from nanolight.callbacks.throughput import lookup_peak_flops
from nanolight.module import NanoModule
from nanolight.trainer import NanoTrainer


def _trainer(tmp_path, **kw) -> NanoTrainer:
    kw.setdefault("logger", False)
    kw.setdefault("enable_progress_bar", False)
    kw.setdefault("enable_checkpointing", False)
    return NanoTrainer(default_root_dir=tmp_path, **kw)


class ParamDtype(Callback):
    def __init__(self) -> None:
        self.seen: set = set()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.seen |= {(p.dtype, p.grad.dtype) for p in pl_module.parameters()}


class AutocastProbe(MLPModule):
    def training_step(self, batch, batch_idx):
        x, y = batch
        self.out_dtype = self.model(x).dtype
        return super().training_step(batch, batch_idx)


def test_bf16_mixed_keeps_fp32_params_and_grads(tmp_path):
    probe, module = ParamDtype(), AutocastProbe()
    trainer = _trainer(
        tmp_path, max_steps=3, precision="bf16-mixed", accumulate_grad_batches=2, callbacks=[probe]
    )
    trainer.fit(module, loader(make_data(32), 4))
    assert probe.seen == {(torch.float32, torch.float32)}
    assert module.out_dtype == torch.bfloat16  # the forward ran under autocast
    assert math.isfinite(float(trainer.callback_metrics["train/loss"]))


def test_bf16_true_casts_params(tmp_path):
    module = MLPModule()
    _trainer(tmp_path, max_steps=1, precision="bf16-true").fit(module, loader(make_data(16), 4))
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}


class NaNAt(MLPModule):
    def __init__(self, bad_steps: set[int]) -> None:
        super().__init__()
        self.bad_steps = bad_steps

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.trainer.global_step + 1 in self.bad_steps else loss


def test_nan_guard_skips_step(tmp_path):
    guard, module = NaNGuard(action="skip"), NaNAt({2})
    trainer = _trainer(tmp_path, max_steps=2, callbacks=[guard])
    with pytest.warns(UserWarning, match="non-finite train/loss=nan at step 2: skipping the optimizer step"):
        trainer.fit(module, loader(make_data(16), 4))
    before = [p.detach().clone() for p in module.parameters()]
    # step 2 skipped: weights equal those after one step of a clean run
    clean = MLPModule()
    _trainer(tmp_path, max_steps=1).fit(clean, loader(make_data(16), 4))
    assert all(torch.equal(a, b) for a, b in zip(before, clean.parameters(), strict=True))
    assert guard.skipped_steps == [2] and trainer.global_step == 2 and not trainer.should_stop


def test_nan_guard_stop_names_step_and_metric(tmp_path):
    guard = NaNGuard(action="stop")
    trainer = _trainer(tmp_path, max_steps=10, callbacks=[guard])
    with pytest.warns(UserWarning, match=r"non-finite train/loss=nan at step 3"):
        trainer.fit(NaNAt({3}), loader(make_data(64), 4))
    assert trainer.global_step == 3 and guard.stopped_reason == "non-finite train/loss=nan at step 3"


class ValLossSequence(MLPModule):
    """val/loss = 1, 0.5, 0.6, 0.7, 0.8, ... (improves once, then gets worse)."""

    def __init__(self) -> None:
        super().__init__()
        self.values = iter([1.0, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0])

    def on_validation_epoch_start(self) -> None:
        self.current = next(self.values)

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.current)


def test_early_stopping(tmp_path):
    # val_check_interval=1 (int) == 1.0, so Lightning would check only at epoch ends: ask for validation ends
    es = EarlyStopping(monitor="val/loss", patience=2, check_on_train_epoch_end=False)
    trainer = _trainer(
        tmp_path,
        max_steps=100,
        val_check_interval=1,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        callbacks=[es],
    )  # no sanity check: it would draw the first value
    data = loader(make_data(64), 4)
    trainer.fit(ValLossSequence(), data, data)
    assert trainer.global_step == 4 and trainer.should_stop  # best at step 2, no improvement at 3, 4
    assert float(es.best_score) == 0.5 and "did not improve" in es.stopping_reason_message
    assert (es.wait_count, es.stopped_epoch) == (2, 0)


def test_model_checkpoint_top_k_and_keep_last_n(tmp_path):
    names = {"filename": "step-{step}", "auto_insert_metric_name": False}
    top = ModelCheckpoint(
        dirpath=tmp_path / "top",
        every_n_train_steps=1,
        monitor="val/loss",
        save_top_k=2,
        save_last=True,
        **names,
    )
    newest = ModelCheckpoint(dirpath=tmp_path / "newest", every_n_train_steps=2, keep_last_n=2, **names)
    trainer = _trainer(
        tmp_path, max_steps=7, val_check_interval=1, limit_val_batches=1, num_sanity_val_steps=0,
        enable_checkpointing=True, callbacks=[top, newest],
    )  # fmt: skip
    data = loader(make_data(64), 4)
    trainer.fit(ValLossSequence(), data, data)
    # a step-triggered save runs at the end of step s, before that step's validation, so step s
    # sees the val of s-1; step 1 has none yet (deferred, as Lightning). Scores: step2=1.0,
    # step3=0.5, step4=0.6, step5=0.7, ... -> top two: step-3, step-4; save_last keeps the newest
    assert sorted(p.name for p in (tmp_path / "top").iterdir()) == ["last", "step-3", "step-4", "step-7"]
    assert top.best_model_path.endswith("step-3") and float(top.best_model_score) == 0.5
    assert {Path(p).name: float(v) for p, v in top.best_k_models.items()} == pytest.approx(
        {"step-3": 0.5, "step-4": 0.6}
    )
    # no monitor, save_top_k=1: the newest, plus keep_last_n=2 newest; every save moves `last`
    assert sorted(p.name for p in (tmp_path / "newest").iterdir()) == ["last", "step-4", "step-6"]
    assert (tmp_path / "top" / "last").read_text().strip() == "step-7"


def test_fast_dev_run(tmp_path):
    trainer = NanoTrainer(fast_dev_run=2, default_root_dir=tmp_path, enable_progress_bar=False)
    data = loader(make_data(64), 4)
    trainer.fit(MLPModule(), data, data)
    # as Lightning: no loggers, and the ModelCheckpoint stays but saves nothing
    assert trainer.global_step == 2 and trainer.loggers == [] and len(trainer.checkpoint_callbacks) == 1
    assert "val/loss" in trainer.callback_metrics
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.csv").exists()


class TokenLM(NanoModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 32))

    def training_step(self, batch, batch_idx):
        logits = self.model(batch["input_ids"])
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def flops_per_token(self) -> float:
        return 6.0 * sum(p.numel() for p in self.parameters())


def test_throughput_monitor_and_progress_bar_without_tty(tmp_path, capsys):
    ids = torch.randint(0, 32, (64, 8))
    data = DataLoader([{"input_ids": r, "labels": r} for r in ids], batch_size=4)
    tm = ThroughputMonitor(peak_flops=1e12)
    trainer = _trainer(
        tmp_path,
        max_steps=4,
        accumulate_grad_batches=2,
        log_every_n_steps=2,
        callbacks=[tm, RichProgressBar()],
    )
    trainer.fit(TokenLM(), data)
    assert trainer.progress["tokens"] == 4 * 2 * 4 * 8 and trainer.progress["samples"] == 32
    m = {k: float(v) for k, v in trainer.callback_metrics.items()}  # no logger: nothing is logged
    assert m["throughput/tokens_per_sec"] > 0
    assert m["throughput/tflops_per_device"] == pytest.approx(
        m["throughput/tokens_per_sec"] * tm.flops_per_token / 1e12
    )
    assert m["throughput/mfu"] == pytest.approx(m["throughput/tflops_per_device"])  # peak = 1 TFLOP/s
    out = capsys.readouterr().out
    assert "step 2/4  loss" in out and "step 4/4" in out  # plain lines when stdout is not a tty


class _Timed(ThroughputMonitor):
    def __init__(self) -> None:
        super().__init__()
        self.timed: list[tuple[int, int]] = []  # (global step, steps in the interval)

    def on_timed(self, trainer, seconds, steps) -> None:
        self.timed.append((trainer.global_step, steps))
        super().on_timed(trainer, seconds, steps)


def test_accumulation_times_whole_steps_once_per_logged_step(tmp_path, capsys):
    """With accumulation a logging step is timed (and printed) once, after its update, over the
    whole interval: never at a micro-batch of a step still in progress."""
    ids = torch.randint(0, 32, (64, 8))
    data = DataLoader([{"input_ids": r, "labels": r} for r in ids], batch_size=4)
    tm = _Timed()
    trainer = _trainer(
        tmp_path,
        max_steps=6,
        accumulate_grad_batches=3,
        log_every_n_steps=2,
        callbacks=[tm, RichProgressBar()],
    )
    trainer.fit(TokenLM(), data)
    assert tm.timed == [(2, 2), (4, 2), (6, 2)]
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step ")]
    assert [ln.split()[1] for ln in lines] == ["2/6", "4/6", "6/6"]


class ValidatedLM(TokenLM):
    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.training_step(batch, batch_idx), prog_bar=True)


def test_plain_lines_keep_the_eta_and_show_each_validation_once(tmp_path, capsys):
    """Piped (stdout not a tty): every logged step's line has the elapsed time and the ETA; a
    validation's value is printed once, on its own line, and never again on later steps' lines."""
    ids = torch.randint(0, 32, (64, 8))
    data = DataLoader([{"input_ids": r, "labels": r} for r in ids], batch_size=4)
    trainer = _trainer(
        tmp_path,
        max_steps=8,
        log_every_n_steps=2,
        val_check_interval=4,
        limit_val_batches=2,
        callbacks=[RichProgressBar()],
    )
    trainer.fit(ValidatedLM(), data, data)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step ")]
    steps = [ln for ln in lines if "/8" in ln]
    assert [ln.split()[1] for ln in steps] == ["2/8", "4/8", "6/8", "8/8"], lines
    assert all("elapsed " in ln and "ETA " in ln for ln in steps), steps
    assert not any("val/loss" in ln for ln in steps), steps  # no stale validation on a step's line
    validations = [ln for ln in lines if "val/loss" in ln]
    assert [ln.split()[1] for ln in validations] == ["4", "8"], lines


# lightning.fabric.utilities.throughput.get_available_flops (Lightning 2.6.6, recorded with the device
# name patched and _is_ampere_or_later True): (float32 with matmul precision "highest", "high", bf16).
LIGHTNING_PEAKS = {
    "NVIDIA H100 80GB HBM3": (66.9e12, 494.7e12, 989.4e12),
    "NVIDIA H100 PCIe": (51.2e12, 378e12, 756e12),
    "NVIDIA A100-SXM4-80GB": (19.5e12, 156e12, 312e12),
    "NVIDIA A100-SXM4-40GB": (19.5e12, 156e12, 312e12),
    "NVIDIA L4": (30.3e12, 60e12, 121e12),
    "NVIDIA A10G": (31.2e12, 62.5e12, 125e12),
}


@pytest.mark.parametrize("name", sorted(LIGHTNING_PEAKS))
def test_peak_flops_counts_tf32_as_lightning_does(name, monkeypatch):
    """32-true's peak is TF32's while fp32 matmuls may use TF32, plain fp32's under "highest";
    the figures are the planner's table (datasheets rounded to 3 digits, Lightning's to 4)."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    cuda = torch.device("cuda", 0)
    fp32, tf32, bf16 = LIGHTNING_PEAKS[name]
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert lookup_peak_flops(cuda, "32-true") == pytest.approx(fp32, rel=0.01)
        torch.set_float32_matmul_precision("high")
        assert lookup_peak_flops(cuda, "32-true") == pytest.approx(tf32, rel=0.01)
    finally:
        torch.set_float32_matmul_precision(before)
    for mode in ("bf16-mixed", "bf16-true", "bf16-master"):
        assert lookup_peak_flops(cuda, mode) == pytest.approx(bf16, rel=0.01)
    assert lookup_peak_flops(torch.device("cpu"), "32-true") is None


def test_throughput_without_peak_omits_mfu(tmp_path):
    ids = torch.randint(0, 32, (16, 8))
    data = DataLoader([{"input_ids": r, "labels": r} for r in ids], batch_size=4)
    trainer = _trainer(tmp_path, max_steps=2, log_every_n_steps=1, callbacks=[ThroughputMonitor()])
    trainer.fit(TokenLM(), data)
    assert "throughput/tflops_per_device" in trainer.callback_metrics
    assert "throughput/mfu" not in trainer.callback_metrics  # CPU: unknown peak


class Epochs(Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []  # (global step, epoch) after each update

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seen.append((trainer.global_step, trainer.current_epoch))


def test_save_on_train_end_saves_the_last_step_inside_its_epoch(tmp_path):
    """max_steps ends a run mid-epoch: the step is saved as a step-triggered save would save it
    (Lightning's loop counts the epoch as ended once training stops), so resuming it continues
    that epoch, as the uninterrupted run does."""

    def fit(root, max_steps, ckpt_path=None) -> Epochs:
        epochs = Epochs()
        ckpt = ModelCheckpoint(  # as the recipe: no save at epoch ends, every 100 steps and the last
            dirpath=root,
            filename="step-{step}",
            every_n_train_steps=100,
            save_on_train_end=True,
            save_top_k=-1,
        )
        trainer = _trainer(root, max_steps=max_steps, enable_checkpointing=True, callbacks=[ckpt, epochs])
        trainer.fit(MLPModule(), loader(make_data(64), 4), ckpt_path=ckpt_path)  # 16 steps an epoch
        return epochs

    fit(tmp_path / "split", 5)
    resumed = fit(tmp_path / "split", 10, "last")
    full = fit(tmp_path / "full", 10)
    assert resumed.seen == full.seen[5:] and {e for _, e in full.seen} == {0}, resumed.seen
