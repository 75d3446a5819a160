"""Callbacks: the `Callback` base (Lightning's hook names) and the built-ins."""

from typing import Any

from nanolight.callbacks.base import Callback
from nanolight.callbacks.early_stopping import EarlyStopping
from nanolight.callbacks.lambda_function import LambdaCallback
from nanolight.callbacks.lr_monitor import LearningRateMonitor
from nanolight.callbacks.model_checkpoint import ModelCheckpoint
from nanolight.callbacks.model_summary import ModelSummary
from nanolight.callbacks.nan_guard import DivergenceCheck, NaNGuard
from nanolight.callbacks.progress import GreedySamples, RichProgressBar
from nanolight.callbacks.throughput import ThroughputMonitor
from nanolight.callbacks.timer import Timer
from nanolight.errors import missing_name

__all__ = [
    "Callback",
    "DivergenceCheck",
    "EarlyStopping",
    "GreedySamples",
    "LambdaCallback",
    "LearningRateMonitor",
    "ModelCheckpoint",
    "ModelSummary",
    "NaNGuard",
    "RichProgressBar",
    "ThroughputMonitor",
    "Timer",
]


def __getattr__(name: str) -> Any:
    """Lightning's names nanolight lacks fail with what to use instead (`errors.LIGHTNING_ONLY`)."""
    raise missing_name(__name__, name)
