"""Hooks attached to instances, as Lightning's own hook-order tests record them.

Every hook of a ``BoringModel`` instance and of a plain ``Callback()`` instance is replaced by a
recorder made with ``functools.partial`` + ``update_wrapper`` (the classes override nothing), so
the trainer must call hooks found on the instance. Pins the order and count of every call over
fit (2 epochs x 2 batches, validation, the default ModelCheckpoint), validate, test and predict.

Run: ``python hook_recorder.py OUTDIR``.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import lightning as L
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from observe import run_summary, write_observed

MODULE_HOOKS = [
    "configure_callbacks", "prepare_data", "setup", "configure_model", "configure_optimizers",
    "on_fit_start", "on_fit_end", "on_train_start", "on_train_end", "on_train_epoch_start",
    "on_train_epoch_end", "on_train_batch_start", "on_train_batch_end", "on_validation_start",
    "on_validation_end", "on_validation_epoch_start", "on_validation_epoch_end",
    "on_validation_batch_start", "on_validation_batch_end", "on_validation_model_eval",
    "on_validation_model_train", "on_validation_model_zero_grad", "on_test_start", "on_test_end",
    "on_test_epoch_start", "on_test_epoch_end", "on_test_batch_start", "on_test_batch_end",
    "on_test_model_eval", "on_test_model_train", "on_predict_start", "on_predict_end",
    "on_predict_epoch_start", "on_predict_epoch_end", "on_predict_batch_start", "on_predict_batch_end",
    "on_predict_model_eval", "on_before_batch_transfer", "transfer_batch_to_device",
    "on_after_batch_transfer", "on_before_backward", "backward", "on_after_backward",
    "on_before_optimizer_step", "on_before_zero_grad", "optimizer_zero_grad", "optimizer_step",
    "configure_gradient_clipping", "lr_scheduler_step", "on_save_checkpoint", "on_load_checkpoint",
    "teardown", "train_dataloader", "val_dataloader", "test_dataloader", "predict_dataloader",
]  # fmt: skip
CALLBACK_HOOKS = [
    "setup", "teardown", "on_fit_start", "on_fit_end", "on_sanity_check_start", "on_sanity_check_end",
    "on_train_start", "on_train_end", "on_train_epoch_start", "on_train_epoch_end",
    "on_train_batch_start", "on_train_batch_end", "on_validation_start", "on_validation_end",
    "on_validation_epoch_start", "on_validation_epoch_end", "on_validation_batch_start",
    "on_validation_batch_end", "on_test_start", "on_test_end", "on_test_epoch_start",
    "on_test_epoch_end", "on_test_batch_start", "on_test_batch_end", "on_predict_start",
    "on_predict_end", "on_predict_epoch_start", "on_predict_epoch_end", "on_predict_batch_start",
    "on_predict_batch_end", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
    "on_before_zero_grad", "on_save_checkpoint", "state_dict",
]  # fmt: skip


def record(who: str, name: str, fn: Any, trace: list[Any], *args: Any, **kwargs: Any) -> Any:
    trace.append([who, name])
    return fn(*args, **kwargs)


def attach(obj: Any, who: str, names: list[str], trace: list[Any]) -> None:
    """Replace each hook on the instance by a recorder that calls the original."""
    for name in names:
        original = getattr(obj, name)
        recorder = functools.partial(record, who, name, original, trace)
        functools.update_wrapper(recorder, original)
        setattr(obj, name, recorder)


def main(outdir: str) -> None:
    L.seed_everything(3)
    trace: list[Any] = []
    model = BoringModel()
    callback = L.Callback()
    attach(model, "module", MODULE_HOOKS, trace)
    attach(callback, "callback", CALLBACK_HOOKS, trace)
    trainer = L.Trainer(
        max_epochs=2,
        limit_train_batches=2,
        limit_val_batches=1,
        limit_test_batches=1,
        limit_predict_batches=1,
        num_sanity_val_steps=1,
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        callbacks=[callback],
        default_root_dir=outdir,
    )
    phases: dict[str, Any] = {}
    for phase, call in [
        ("fit", lambda: trainer.fit(model)),
        ("validate", lambda: trainer.validate(model, verbose=False)),
        ("test", lambda: trainer.test(model, verbose=False)),
        ("predict", lambda: trainer.predict(model)),
    ]:
        trace.append(["program", phase])
        out = call()
        phases[phase] = None if phase in ("fit", "predict") else out
    observed = {
        "trace": trace,
        "returned": phases,
        "predict_shapes": [list(torch.as_tensor(p).shape) for p in trainer.predict(model)],
        **run_summary(trainer, model, outdir),
    }
    write_observed(outdir, observed)


if __name__ == "__main__":
    main(sys.argv[1])
