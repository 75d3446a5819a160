"""Parts of Lightning's Trainer surface a ported program relies on that the recorded programs do not
pin: a ``weights_only`` checkpoint (evaluates and rebuilds a module, but cannot resume a fit),
each Lightning argument nanolight deliberately does not take (an error naming it and why), and
``test``/``predict(ckpt_path="best")`` restoring the monitored ModelCheckpoint's best -- not the
newest -- checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _trainer_helpers import MLPModule, loader, make_data

from nanolight import NanoTrainer
from nanolight.callbacks import ModelCheckpoint
from nanolight.checkpoint import CheckpointReader
from nanolight.errors import UsageError
from nanolight.trainer.arguments import UNSUPPORTED

QUIET = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}


class Evaluated(MLPModule):
    """The MLP regression with test and predict steps (the same loss as validation)."""

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test/loss", self.loss(batch))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(batch[0]).squeeze(-1)


def _weights(module: MLPModule) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


def test_weights_only_checkpoint_evaluates_and_loads_but_does_not_resume(tmp_path: Path) -> None:
    data = loader(make_data(32), 8)
    trainer = NanoTrainer(max_steps=3, default_root_dir=tmp_path, enable_checkpointing=False, **QUIET)
    module = Evaluated()
    trainer.fit(module, train_dataloaders=data)
    want = trainer.validate(module, dataloaders=data, verbose=False)
    path = tmp_path / "weights"
    trainer.save_checkpoint(path, weights_only=True)
    reader = CheckpointReader.open(path)
    assert reader.optimizer_groups() == [] and not reader.names("optim/")  # no optimizer state saved

    resume = NanoTrainer(max_steps=6, default_root_dir=tmp_path, enable_checkpointing=False, **QUIET)
    with pytest.raises(
        UsageError, match=r"holds only weights .*no optimizer, LR scheduler or loop state"
    ) as info:
        resume.fit(Evaluated(), train_dataloaders=data, ckpt_path=path)
    assert str(path) in str(info.value) and "load_from_checkpoint" in str(info.value)
    assert resume.global_step == 0  # refused before any step

    fresh = NanoTrainer(default_root_dir=tmp_path, enable_checkpointing=False, **QUIET)
    other = Evaluated(seed=5)  # other initial weights: the checkpoint's must be restored
    assert fresh.validate(other, dataloaders=data, ckpt_path=path, verbose=False) == want
    loaded = Evaluated.load_from_checkpoint(path)
    for name, tensor in _weights(module).items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0, msg=name)


# a value that asks for the feature (Lightning's default for each is accepted: trainer_args program)
ASKING = {"profiler": "simple", "plugins": [object()], "sync_batchnorm": True, "model_registry": "my-model"}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_each_unsupported_lightning_argument_is_an_error_naming_it_and_why(name: str) -> None:
    assert ASKING.keys() == UNSUPPORTED.keys()  # a new entry needs a value here
    with pytest.raises(UsageError) as info:
        NanoTrainer(**{name: ASKING[name]})
    message = str(info.value)
    assert f"NanoTrainer({name}=...)" in message and "nanolight does not support" in message
    assert UNSUPPORTED[name] in message  # the why / what to use instead


def test_unknown_argument_is_a_type_error_even_next_to_an_unsupported_default() -> None:
    with pytest.raises(TypeError, match=r"unexpected arguments \['max_step'\]"):
        NanoTrainer(max_step=3, sync_batchnorm=False)


def test_test_and_predict_with_ckpt_path_best_restore_the_monitored_best(tmp_path: Path) -> None:
    data = loader(make_data(32), 8)
    # mode="max" on a falling loss: the best is the first epoch's checkpoint, not the newest
    ckpt = ModelCheckpoint(
        dirpath=tmp_path / "ckpts", monitor="val/loss", mode="max", save_top_k=1, save_last=True
    )
    trainer = NanoTrainer(
        max_epochs=3, callbacks=[ckpt], default_root_dir=tmp_path, num_sanity_val_steps=0, **QUIET
    )
    module = Evaluated(lr=0.05)
    trainer.fit(module, train_dataloaders=data, val_dataloaders=data)
    assert Path(ckpt.best_model_path).name.startswith("epoch=0-")
    best = Evaluated.load_from_checkpoint(ckpt.best_model_path)
    assert not torch.equal(best.state_dict()["model.0.weight"], module.state_dict()["model.0.weight"])

    (tested,) = trainer.test(module, dataloaders=data, ckpt_path="best", verbose=False)
    assert trainer.ckpt_path == ckpt.best_model_path
    assert tested["test/loss"] == pytest.approx(float(ckpt.best_model_score), rel=1e-6)
    for name, tensor in best.state_dict().items():
        torch.testing.assert_close(module.state_dict()[name], tensor, rtol=0, atol=0, msg=name)

    with torch.no_grad():  # weights the restore must replace
        for p in module.parameters():
            p.add_(1.0)
    predictions = trainer.predict(module, dataloaders=data, ckpt_path="best")
    assert trainer.ckpt_path == ckpt.best_model_path
    with torch.no_grad():
        want = [best.model(x).squeeze(-1) for x, _ in data]
    assert len(predictions) == len(want)
    for got, expected in zip(predictions, want, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_model_summary_is_exported_and_replaces_the_default() -> None:
    """``lightning.pytorch.callbacks.ModelSummary``: a user's instance is the only one (Lightning's
    ``callback_connector._configure_model_summary_callback`` adds its default only when none is given)."""
    from nanolight.callbacks import ModelSummary  # ImportError before it was exported

    mine = ModelSummary(max_depth=2)
    trainer = NanoTrainer(callbacks=[mine], logger=False, enable_checkpointing=False)
    assert [cb for cb in trainer.callbacks if isinstance(cb, ModelSummary)] == [mine]
