"""The errors nanolight raises on purpose: what is wrong and how to fix it, in one message.

Entry points (the recipe) print them as one line, ``nanolight: error: ...``, without a traceback
(``HYDRA_FULL_ERROR=1`` or ``--debug`` shows it); any other exception is a bug and keeps its
traceback. Each subclass also derives from the built-in a caller would catch (``ValueError``...).
"""

from __future__ import annotations


class NanolightError(Exception):
    """Base class. `rank_specific`: only the rank that raised it knows (e.g. its disk is full), so
    that rank prints it too, not just rank 0."""

    rank_specific = False


class UsageError(NanolightError, ValueError):
    """A setting or input that cannot work (a layout, a loader, a return value); says the fix."""


class TrainingDiverged(NanolightError, RuntimeError):
    """The loss or gradient norm stopped being finite: training on would only spread NaN, and a
    checkpoint of that state would rotate the last good one away."""


class NotSupported(NanolightError, ImportError):
    """A Lightning name nanolight does not have (``from nanolight.callbacks import
    StochasticWeightAveraging``): one line saying what to use instead, not a bare ImportError."""


# What Lightning 2.6 exports from `lightning.pytorch.<package>` that nanolight does not, and what to use.
_LOGGING = "log with self.log and a CSVLogger or WandbLogger (nanolight.loggers)"
_CALLBACK = "write it as a Callback (nanolight.callbacks.Callback) or a LambdaCallback"
LIGHTNING_ONLY: dict[str, dict[str, str]] = {
    "callbacks": {
        **dict.fromkeys(
            ("BackboneFinetuning", "BaseFinetuning", "ModelPruning", "SpikeDetection"), _CALLBACK
        ),
        **dict.fromkeys(("StochasticWeightAveraging", "EMAWeightAveraging", "WeightAveraging"), _CALLBACK),
        "BasePredictionWriter": "collect what trainer.predict returns, or write it in on_predict_batch_end",
        "BatchSizeFinder": "set the batch size yourself (the recipe's planner, +parallel=auto, sizes it)",
        "LearningRateFinder": "set the learning rate yourself",
        "Checkpoint": "subclass ModelCheckpoint or Callback",
        "DeviceStatsMonitor": "ThroughputMonitor (tokens/s, MFU) or torch.cuda.max_memory_allocated in a Callback",
        "GradientAccumulationScheduler": "NanoTrainer(accumulate_grad_batches=N), fixed for the run",
        "OnExceptionCheckpoint": "Callback.on_exception with trainer.save_checkpoint",
        **dict.fromkeys(("ProgressBar", "TQDMProgressBar"), "RichProgressBar (the default)"),
        "RichModelSummary": "ModelSummary",
    },
    "loggers": {
        **dict.fromkeys(("CometLogger", "LitLogger", "MLFlowLogger", "TensorBoardLogger"), _LOGGING),
    },
    "utilities": {
        "CombinedLoader": "one DataLoader per call, or a list of loaders for validation/test",
        "GradClipAlgorithmType": "the strings 'norm' and 'value'",
        "LightningEnum": "enum.StrEnum",
        "move_data_to_device": "NanoModule.transfer_batch_to_device (the trainer moves batches itself)",
        **dict.fromkeys(("find_shared_parameters", "set_shared_parameters"), "tie weights in your model"),
        **dict.fromkeys(
            (
                "disable_possible_user_warnings",
                "is_picklable",
                "is_shared_filesystem",
                "suggested_max_num_workers",
            ),
            "the standard library (warnings, pickle, os.cpu_count)",
        ),
        **dict.fromkeys(("FLOAT16_EPSILON", "FLOAT32_EPSILON", "FLOAT64_EPSILON"), "torch.finfo(dtype).eps"),
    },
    "profilers": {
        **dict.fromkeys(
            (
                "Profiler",
                "AdvancedProfiler",
                "PassThroughProfiler",
                "PyTorchProfiler",
                "SimpleProfiler",
                "XLAProfiler",
            ),
            "torch.profiler.profile around trainer.fit, or ThroughputMonitor for step timings",
        ),
    },
}


def missing_name(module: str, name: str) -> AttributeError | NotSupported:
    """The error for ``module.name`` (a package's ``__getattr__``): `NotSupported` naming the
    alternative for a Lightning name, the usual AttributeError otherwise (so ``hasattr`` and
    submodule imports work)."""
    alternative = LIGHTNING_ONLY.get(module.rpartition(".")[2], {}).get(name)
    if alternative is None:
        return AttributeError(f"module {module!r} has no attribute {name!r}")
    return NotSupported(
        f"{module}.{name} (Lightning's) is not supported by nanolight: {alternative}", name=name
    )
