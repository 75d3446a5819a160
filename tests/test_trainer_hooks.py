"""Hook order matches Lightning's.

Expected order written out from Lightning's hook pseudocode
(https://lightning.ai/docs/pytorch/stable/common/lightning_module.html#hooks, "callbacks first,
then the LightningModule": https://lightning.ai/docs/pytorch/stable/common/hooks.html) and
checked against lightning 2.6.6 on the same scenario: max_steps=2, accumulate_grad_batches=2,
validation after batch 4 (= step 2; 1 batch, no sanity check), ModelCheckpoint every 2 steps.
Note the zero_grad hook fires after the first micro-batch's training_step, before its backward.
The full trace, every hook of module and callback against a recording of Lightning itself, is
`test_lightning_fidelity.py` (hook_order).
"""

from __future__ import annotations

from _trainer_helpers import MLPModule, loader, make_data

from nanolight.callbacks import Callback, ModelCheckpoint
from nanolight.trainer import NanoTrainer

HOOKS = [
    "setup", "on_fit_start", "on_train_start", "on_train_epoch_start", "on_train_batch_start",
    "on_before_backward", "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad",
    "on_train_batch_end", "on_validation_start", "on_validation_epoch_start",
    "on_validation_batch_start", "on_validation_batch_end", "on_validation_epoch_end",
    "on_validation_end", "on_train_epoch_end", "on_train_end", "on_fit_end", "teardown",
    "on_save_checkpoint", "on_load_checkpoint", "on_exception",
]  # fmt: skip

LIGHTNING_FIT_ORDER = [
    "setup", "on_fit_start", "on_train_start", "on_train_epoch_start",
    # optimizer step 1 = micro-batches 0, 1
    "on_train_batch_start(0)", "on_before_zero_grad", "on_before_backward", "on_after_backward",
    "on_train_batch_end(0)",
    "on_train_batch_start(1)", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
    "on_train_batch_end(1)",
    # optimizer step 2 = micro-batches 2, 3; then the checkpoint, then validation
    "on_train_batch_start(2)", "on_before_zero_grad", "on_before_backward", "on_after_backward",
    "on_train_batch_end(2)",
    "on_train_batch_start(3)", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
    "on_train_batch_end(3)", "on_save_checkpoint",
    "on_validation_start", "on_validation_epoch_start", "on_validation_batch_start",
    "on_validation_batch_end", "on_validation_epoch_end", "on_validation_end",
    "on_train_epoch_end", "on_train_end", "on_fit_end", "teardown",
]  # fmt: skip


def _recorder(calls: list[str], prefix: str = ""):
    def make(hook: str):
        def fn(self, trainer, pl_module, *args, **kwargs):  # setup/teardown: stage= (Lightning)
            suffix = f"({args[-1]})" if hook in ("on_train_batch_start", "on_train_batch_end") else ""
            calls.append(prefix + hook + suffix)

        return fn

    return type("Recorder", (Callback,), {h: make(h) for h in HOOKS})()


class RecordingModule(MLPModule):
    """Records its own hooks too, to check callbacks run before the module."""

    def __init__(self, calls: list[str]) -> None:
        super().__init__()
        self.calls = calls

    def on_before_optimizer_step(self, optimizer) -> None:
        self.calls.append("module:on_before_optimizer_step")

    def on_train_start(self) -> None:
        self.calls.append("module:on_train_start")


def _trainer(tmp_path, calls, **kw) -> NanoTrainer:
    return NanoTrainer(
        max_steps=2, accumulate_grad_batches=2, val_check_interval=4, limit_val_batches=1, num_sanity_val_steps=0,
        callbacks=[_recorder(calls), ModelCheckpoint(every_n_train_steps=2)], logger=False,
        enable_progress_bar=False, default_root_dir=tmp_path, **kw,
    )  # fmt: skip


def test_fit_hook_order_matches_lightning(tmp_path):
    calls: list[str] = []
    ds = make_data(16)
    _trainer(tmp_path, calls).fit(RecordingModule(calls), loader(ds, 2), loader(ds, 2))
    callback_calls = [c for c in calls if not c.startswith("module:")]
    assert callback_calls == LIGHTNING_FIT_ORDER
    # callbacks before the module, for the same hook
    i = calls.index("module:on_train_start")
    assert calls[i - 1] == "on_train_start"
    i = calls.index("module:on_before_optimizer_step")
    assert calls[i - 1] == "on_before_optimizer_step"


def test_resume_calls_on_load_checkpoint_before_fit_start(tmp_path):
    ds = make_data(16)
    _trainer(tmp_path, []).fit(MLPModule(), loader(ds, 2))
    calls: list[str] = []
    trainer = _trainer(tmp_path, calls)
    trainer.config.max_steps = 3
    trainer.fit(MLPModule(), loader(ds, 2), ckpt_path="last")
    assert calls[:3] == ["setup", "on_load_checkpoint", "on_fit_start"]
    assert trainer.global_step == 3


def test_exception_hook_then_reraise(tmp_path):
    calls: list[str] = []

    class Boom(MLPModule):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("boom")

    trainer = _trainer(tmp_path, calls)
    try:
        trainer.fit(Boom(), loader(make_data(16), 2))
    except RuntimeError as e:
        assert str(e) == "boom"
    else:
        raise AssertionError("expected the exception to propagate")
    assert calls[-1] == "on_exception"
