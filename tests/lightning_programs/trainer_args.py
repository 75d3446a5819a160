"""Every Lightning 2.6 ``Trainer`` argument spelled out at its default value, and a misspelled one.

Pins that a program which writes Lightning's defaults explicitly (``profiler=None``,
``sync_batchnorm=False``, ``plugins=None`` ... included) constructs the same trainer (its loop
options and device counts as read back), and that an unknown argument is a ``TypeError`` naming
it. The argument list is checked against ``inspect.signature(L.Trainer)`` when recorded, so a
Lightning version that adds one fails the recording instead of silently passing.

Run: ``python trainer_args.py OUTDIR``.
"""

from __future__ import annotations

import inspect
import os
import sys

import lightning as L
from observe import write_observed

DEFAULTS = dict(
    accelerator="auto", strategy="auto", devices="auto", num_nodes=1, precision=None, logger=None,
    callbacks=None, fast_dev_run=False, max_epochs=None, min_epochs=None, max_steps=-1, min_steps=None,
    max_time=None, limit_train_batches=None, limit_val_batches=None, limit_test_batches=None,
    limit_predict_batches=None, overfit_batches=0.0, val_check_interval=None, check_val_every_n_epoch=1,
    num_sanity_val_steps=None, log_every_n_steps=None, enable_checkpointing=None, enable_progress_bar=None,
    enable_model_summary=None, accumulate_grad_batches=1, gradient_clip_val=None, gradient_clip_algorithm=None,
    deterministic=None, benchmark=None, inference_mode=True, use_distributed_sampler=True, profiler=None,
    detect_anomaly=False, barebones=False, plugins=None, sync_batchnorm=False,
    reload_dataloaders_every_n_epochs=0, default_root_dir=None, enable_autolog_hparams=True,
    model_registry=None,
)  # fmt: skip
# not max_epochs: Lightning reads None until fit resolves it (1000), nanolight 1000 from the start
READ_BACK = ["max_steps", "min_epochs", "min_steps", "num_devices", "num_nodes", "world_size",
             "global_rank", "local_rank", "is_global_zero", "log_every_n_steps", "num_sanity_val_steps",
             "limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches",
             "val_check_interval", "check_val_every_n_epoch", "accumulate_grad_batches", "gradient_clip_val",
             "gradient_clip_algorithm", "fast_dev_run", "reload_dataloaders_every_n_epochs", "precision"]  # fmt: skip


def main(outdir: str) -> None:
    if L.__name__ == "lightning":  # recording: the list above is all of Lightning's arguments
        params = [p for p in inspect.signature(L.Trainer.__init__).parameters if p != "self"]
        assert params == list(DEFAULTS), sorted(set(params) ^ set(DEFAULTS))
    os.chdir(outdir)  # default_root_dir=None is the working directory
    trainer = L.Trainer(**DEFAULTS)
    observed = {
        "arguments": list(DEFAULTS),
        "read_back": {name: getattr(trainer, name) for name in READ_BACK},
        "root_is_cwd": os.path.samefile(trainer.default_root_dir, outdir),
        "checkpoint_callbacks": len(trainer.checkpoint_callbacks),
        "loggers": len(trainer.loggers),
    }
    try:
        L.Trainer(max_step=3)
    except TypeError as exc:
        observed["misspelled"] = {"error": type(exc).__name__, "names_it": "'max_step'" in str(exc)}
    write_observed(outdir, observed)


if __name__ == "__main__":
    main(sys.argv[1])
