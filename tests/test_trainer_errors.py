"""Misuse gets an error that names the cause."""

from __future__ import annotations

import pytest
import torch
from _trainer_helpers import MLPModule, loader, make_data
from torch import nn

from nanolight.module.optimizers import parse_optimizers
from nanolight.trainer import NanoTrainer


def _fit(tmp_path, module, ckpt_path=None, **kw) -> NanoTrainer:
    trainer = NanoTrainer(
        max_steps=2, logger=False, enable_progress_bar=False, default_root_dir=tmp_path, **kw
    )
    trainer.fit(module, loader(make_data(16), 4), ckpt_path=ckpt_path)
    return trainer


class Returns(MLPModule):
    def __init__(self, out) -> None:
        super().__init__()
        self.out = out

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        return self.out(loss) if callable(self.out) else self.out


@pytest.mark.parametrize(
    ("out", "match"),
    [
        (lambda loss: loss.expand(3), r"loss of shape \(3,\)"),
        (lambda loss: {"x": loss}, "dict without 'loss'"),
        (lambda loss: loss.item(), "returned a float"),
    ],
)
def test_bad_training_step_output(tmp_path, out, match):
    with pytest.raises((TypeError, ValueError), match=match):
        _fit(tmp_path, Returns(out))


def test_training_step_dict_with_loss_is_fine(tmp_path):
    assert _fit(tmp_path, Returns(lambda loss: {"loss": loss, "extra": 1})).global_step == 2


def test_configure_optimizers_forms():
    p = [nn.Parameter(torch.zeros(2))]
    opt = torch.optim.SGD(p, lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    assert parse_optimizers(opt) == ([opt], [])
    opts, scheds = parse_optimizers(([opt], [sched]))
    assert opts == [opt] and scheds[0].scheduler is sched and scheds[0].interval == "epoch"
    opts, scheds = parse_optimizers(
        {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
    )
    assert scheds[0].interval == "step"
    assert parse_optimizers([{"optimizer": opt, "lr_scheduler": sched}])[1][0].scheduler is sched


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"lr_scheduler": None}, 'no "optimizer" key'),
        ("adam", "not an optimizer"),
        ([1, 2], r"sequence of \['int'\]"),
    ],
)
def test_bad_configure_optimizers(bad, match):
    with pytest.raises(TypeError, match=match) as info:
        parse_optimizers(bad)
    assert "Expected an Optimizer" in str(info.value)


def test_bad_scheduler_interval():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    with pytest.raises(ValueError, match="interval"):
        parse_optimizers({"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "batch"}})


def test_bad_configure_optimizers_in_fit(tmp_path):
    class NoReturn(MLPModule):
        def configure_optimizers(self):
            torch.optim.SGD(self.parameters(), lr=0.1)

    # Lightning's behaviour: it warns and trains with no optimizer
    with pytest.warns(UserWarning, match="did you forget `return`"):
        trainer = _fit(tmp_path, NoReturn())
    assert trainer.global_step == 2


def test_checkpoint_from_another_model(tmp_path):
    _fit(tmp_path, MLPModule())  # writes checkpoints/step-2 + last (default ModelCheckpoint at epoch end)
    other = MLPModule(dim=5)  # first layer (16, 5) instead of (16, 8)
    with pytest.raises(ValueError, match=r"model.0.weight: checkpoint \(16, 8\) vs model \(16, 5\)"):
        _fit(tmp_path, other, ckpt_path="last")

    class Renamed(MLPModule):
        def configure_model(self):
            self.net = nn.Linear(8, 1)

    with pytest.raises(ValueError, match="missing in checkpoint: net.weight"):
        _fit(tmp_path, Renamed(), ckpt_path="last")


def test_ckpt_last_without_checkpoint_warns_and_starts_fresh(tmp_path):
    with pytest.warns(UserWarning, match="no checkpoint found"):
        trainer = _fit(tmp_path, MLPModule(), ckpt_path="last", enable_checkpointing=False)
    assert trainer.global_step == 2


def test_missing_explicit_ckpt_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _fit(tmp_path, MLPModule(), ckpt_path=tmp_path / "nope")


def test_bad_trainer_args():
    with pytest.raises(ValueError, match="val_check_interval=1.5: a float is a fraction"):
        NanoTrainer(val_check_interval=1.5)
    with pytest.raises(ValueError, match="a Lightning argument nanolight does not support"):
        NanoTrainer(profiler="simple")
    with pytest.raises(ValueError, match="strategy='fsdp' is not supported"):
        NanoTrainer(strategy="fsdp")
    with pytest.raises(ValueError, match="accelerator='tpu' is not supported"):
        NanoTrainer(accelerator="tpu")
    with pytest.raises(ValueError, match="barebones=True turns off"):
        NanoTrainer(barebones=True, enable_checkpointing=True)
    with pytest.raises(TypeError, match="unexpected arguments"):
        NanoTrainer(max_step=3)
    with pytest.raises(ValueError, match="precision"):
        NanoTrainer(precision="16-mixed")


def test_another_model_size_is_a_short_message_with_the_remedy():
    """Resuming a run with another model size: every block differs, so a few examples, the count,
    and what to do -- not a list of 26 tensors and no remedy."""
    from nanolight.checkpoint.load import check_matches

    model = {f"layers.{i}.mlp.weight": (64, 32) for i in range(26)}
    stored = {f"layers.{i}.mlp.weight": (128, 64) for i in range(26)}
    with pytest.raises(ValueError) as info:
        check_matches(model, stored)
    text = str(info.value)
    assert "shape mismatch: layers.0.mlp.weight: checkpoint (128, 64) vs model (64, 32)" in text
    assert "(26 in all)" in text and text.count("vs model") == 3
    assert "the model it was saved from" in text and "checkpoint.resume=null" in text
