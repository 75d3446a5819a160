"""What `NanoTrainer`'s arguments (Lightning's names and defaults) become: the loop options
(`TrainerConfig`, validated with fix-it messages), the `Strategy` that ``accelerator`` /
``devices`` / ``num_nodes`` / ``strategy`` ask for, the default callbacks and loggers, and the
determinism switches. The Lightning arguments nanolight deliberately does not take are an error
that says so, never silently ignored.

``devices=N`` (or N x ``num_nodes``) processes mean data parallelism, as Lightning's DDP: under
plain ``python script.py`` the script is re-launched as N local processes
(`nanolight/parallel/launcher.py`), under torchrun/srun the processes exist already. One process
is `SingleDeviceStrategy`; tensor and pipeline parallelism are asked for explicitly, with
``strategy=Parallel3DStrategy(tp=..., pp=...)``.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_info

from nanolight.callbacks.base import Callback
from nanolight.callbacks.model_checkpoint import ModelCheckpoint
from nanolight.callbacks.model_summary import ModelSummary
from nanolight.callbacks.progress import RichProgressBar
from nanolight.callbacks.timer import Timer
from nanolight.errors import UsageError
from nanolight.loggers.base import Logger
from nanolight.loggers.csv_logger import CSVLogger
from nanolight.parallel.environment import detect_environment
from nanolight.precision import Precision
from nanolight.strategies.base import SingleDeviceStrategy, Strategy
from nanolight.strategies.parallel3d import Parallel3DStrategy
from nanolight.trainer.hooks import order_callbacks

UNSUPPORTED = {
    "profiler": "profile with torch.profiler around trainer.fit",
    "plugins": "precision and environments are nanolight's own: use precision= and the strategy",
    "sync_batchnorm": "nanolight's data parallelism does not convert BatchNorm layers",
    "model_registry": "there is no model registry: save with trainer.save_checkpoint / save_pretrained",
}


def unsupported_args(kwargs: dict[str, Any]) -> None:
    """Raise for a Lightning argument nanolight does not take (unless at Lightning's default:
    ``sync_batchnorm=False`` asks for nothing), or an unknown one."""
    for key, value in kwargs.items():
        default = False if key == "sync_batchnorm" else None  # Lightning's: it asks for nothing
        if key in UNSUPPORTED and value is not default:
            raise UsageError(
                f"NanoTrainer({key}=...) is a Lightning argument nanolight does not support: {UNSUPPORTED[key]}"
            )
    unknown = sorted(k for k in kwargs if k not in UNSUPPORTED)
    if unknown:
        raise TypeError(f"NanoTrainer got unexpected arguments {unknown}")


def parse_max_time(value: Any) -> float | None:
    """Lightning's forms: "DD:HH:MM:SS", a timedelta, or a dict of timedelta fields -> seconds."""
    if value is None:
        return None
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, dict):
        return datetime.timedelta(**value).total_seconds()
    if isinstance(value, str) and re.fullmatch(r"\d+:\d{1,2}:\d{1,2}:\d{1,2}", value):
        d, h, m, s = (int(x) for x in value.split(":"))
        return datetime.timedelta(days=d, hours=h, minutes=m, seconds=s).total_seconds()
    raise UsageError(
        f'max_time={value!r}: use "DD:HH:MM:SS", a datetime.timedelta or a dict such as {{"hours": 2}}'
    )


def _check_batches(name: str, value: Any, positive: bool = False) -> None:
    """An int count of batches (>= 1 if `positive`, else >= 0) or a float fraction of the loader."""
    least, span = (1, "(0, 1]") if positive else (0, "[0, 1]")
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or value < 0 or (positive and value == 0):
        raise UsageError(f"{name} must be an int >= {least} (batches) or a float in {span}, got {value!r}")
    if isinstance(value, float) and value > 1.0:
        raise UsageError(
            f"{name}={value}: a float is a fraction of the loader in {span}; use an int for a count"
        )


def clip_algorithm(name: str) -> str:
    """``gradient_clip_algorithm``, checked: "norm" or "value" (any case)."""
    if name.lower() not in ("norm", "value"):
        raise UsageError(f'gradient_clip_algorithm must be "norm" or "value", got {name!r}')
    return name.lower()


# the least value of each count (None is Lightning's default where the type allows it)
LEAST = {
    "accumulate_grad_batches": (1, ""),
    "gradient_clip_val": (0, " or None"),
    "check_val_every_n_epoch": (1, " or None"),
    "num_sanity_val_steps": (-1, " (-1: the whole loader)"),
    "log_every_n_steps": (0, " (0: no step rows)"),
    "max_steps": (-1, " (-1: no limit)"),
    "max_epochs": (-1, " (-1: no limit)"),
}


@dataclass
class TrainerConfig:
    """Loop knobs (Lightning's meaning for each). ``val_check_interval``: a float is a fraction of
    the training epoch, an int a count of training batches (with ``check_val_every_n_epoch=None``
    counted across epochs)."""

    max_steps: int = -1
    max_epochs: int | None = None
    min_steps: int | None = None
    min_epochs: int | None = None
    max_time: Any = None
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str | None = None
    val_check_interval: int | float | None = None
    check_val_every_n_epoch: int | None = 1
    num_sanity_val_steps: int | None = None
    limit_train_batches: int | float | None = None
    limit_val_batches: int | float | None = None
    limit_test_batches: int | float | None = None
    limit_predict_batches: int | float | None = None
    overfit_batches: int | float = 0.0
    log_every_n_steps: int | None = None
    fast_dev_run: int | bool = False
    reload_dataloaders_every_n_epochs: int = 0

    def __post_init__(self) -> None:
        for name, (least, note) in LEAST.items():
            value = getattr(self, name)
            if value is not None and value < least:
                raise UsageError(f"{name} must be >= {least}{note}, got {value}")
        if self.gradient_clip_algorithm is not None:
            self.gradient_clip_algorithm = clip_algorithm(self.gradient_clip_algorithm)
        self.max_time_s = parse_max_time(self.max_time)
        self.val_check_interval = 1.0 if self.val_check_interval is None else self.val_check_interval
        _check_batches("val_check_interval", self.val_check_interval, positive=True)
        if self.check_val_every_n_epoch is None and not isinstance(self.val_check_interval, int):
            raise UsageError(
                "check_val_every_n_epoch=None counts val_check_interval across epochs: give it an int"
            )
        self.num_sanity_val_steps = 2 if self.num_sanity_val_steps is None else self.num_sanity_val_steps
        self.log_every_n_steps = 50 if self.log_every_n_steps is None else self.log_every_n_steps
        for name in [f"limit_{kind}_batches" for kind in ("train", "val", "test", "predict")]:
            if getattr(self, name) is None:
                setattr(self, name, 1.0)
            _check_batches(name, getattr(self, name))
        _check_batches("overfit_batches", self.overfit_batches)
        if self.overfit_batches:
            self.limit_train_batches = self.limit_val_batches = self.overfit_batches
        if self.fast_dev_run:
            n = 1 if self.fast_dev_run is True else int(self.fast_dev_run)
            if n < 1:
                raise UsageError(f"fast_dev_run must be True or an int >= 1, got {self.fast_dev_run!r}")
            self.fast_dev_run = n
            self.max_steps, self.max_epochs, self.num_sanity_val_steps = n, 1, 0
            self.limit_train_batches = self.limit_val_batches = n
            self.limit_test_batches = self.limit_predict_batches = n
            self.val_check_interval, self.check_val_every_n_epoch, self.log_every_n_steps = 1.0, 1, 1
        else:
            self.fast_dev_run = 0
        if self.max_epochs is None:  # Lightning's default: 1000 epochs unless another limit is set
            self.max_epochs = 1000 if self.max_steps == -1 and self.max_time_s is None else -1


# ---- the strategy ----------------------------------------------------------------------
UNSUPPORTED_STRATEGIES = {
    "dp": "torch.nn.DataParallel is not supported: use devices=N (data parallel processes)",
    "ddp_spawn": "processes are started by re-running the script (or torchrun): use strategy='ddp' or 'auto'",
    "ddp_fork": "processes are started by re-running the script (or torchrun): use strategy='ddp' or 'auto'",
    "ddp_notebook": "data parallelism needs a script file: run it with python or torchrun",
    "fsdp": "use strategy=Parallel3DStrategy(dp=N, zero_stage=1) (sharded optimizer state) or tp/pp",
    "deepspeed": "use strategy=Parallel3DStrategy(dp=N, zero_stage=1) (ZeRO-1) or tp/pp",
}


def _device_type(accelerator: str) -> str:
    acc = accelerator.lower()
    if acc == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if acc in ("gpu", "cuda"):
        if not torch.cuda.is_available():
            raise UsageError(
                f"accelerator={accelerator!r} but no CUDA device is visible: use accelerator='cpu'"
            )
        return "cuda"
    if acc == "cpu":
        return "cpu"
    raise UsageError(f"accelerator={accelerator!r} is not supported: use 'cpu', 'gpu'/'cuda' or 'auto'")


def _device_ids(devices: Any, device_type: str) -> list[int]:
    """Lightning's ``devices`` forms -> the local device indices (CPU: one 'index' per process)."""
    available = torch.cuda.device_count() if device_type == "cuda" else None
    if devices in ("auto", None):
        return list(range(available)) if available else [0]
    if isinstance(devices, str):
        devices = devices.strip()
        if "," in devices:
            return [int(d) for d in devices.split(",") if d.strip()]
        devices = int(devices)
    if isinstance(devices, (list, tuple)):
        return [int(d) for d in devices]
    if isinstance(devices, int) and not isinstance(devices, bool):
        if devices == -1:
            if available is None:
                raise UsageError(
                    "devices=-1 (all devices) needs accelerator='gpu'; on CPU give a process count"
                )
            return list(range(available))
        if devices >= 1:
            return list(range(devices))
    raise UsageError(f"devices={devices!r}: use an int >= 1, -1 (all GPUs), a list of GPU indices or 'auto'")


def resolve_strategy(
    strategy: Any, accelerator: str, devices: Any, num_nodes: int, precision: Any
) -> Strategy:
    """The strategy a Lightning-style Trainer configuration asks for."""
    if isinstance(strategy, Strategy):
        if devices not in ("auto", None, 1) or num_nodes != 1:
            raise UsageError(
                f"devices={devices!r} / num_nodes={num_nodes} with a Strategy instance: the strategy's own "
                "layout (e.g. Parallel3DStrategy(dp=...)) decides how many processes run; drop devices/num_nodes"
            )
        if precision is not None:
            strategy.precision = Precision(precision)
        return strategy
    if not isinstance(strategy, str) or strategy not in ("auto", "ddp", "single_device"):
        why = UNSUPPORTED_STRATEGIES.get(strategy) if isinstance(strategy, str) else None
        raise UsageError(
            f"strategy={strategy!r} is not supported"
            + (f": {why}" if why else "")
            + "; use 'auto', 'ddp', or a nanolight Strategy (e.g. Parallel3DStrategy(tp=2))"
        )
    if not isinstance(num_nodes, int) or num_nodes < 1:
        raise UsageError(f"num_nodes must be an int >= 1, got {num_nodes!r}")
    device_type = _device_type(accelerator)
    ids = _device_ids(devices, device_type)
    listed = isinstance(devices, (list, tuple)) or (isinstance(devices, str) and "," in devices)
    env = detect_environment()
    # devices=N under srun may be N tasks of one visible GPU each: the launcher checks each rank's
    # device then (`cuda_device_index`); listed GPUs, and N GPUs we start ourselves, must exist here
    if device_type == "cuda" and (listed or env is None) and any(i >= torch.cuda.device_count() for i in ids):
        raise UsageError(f"devices={devices!r} but only {torch.cuda.device_count()} CUDA devices are visible")
    world = len(ids) * num_nodes
    if env is not None and env.world_size != world and (devices, num_nodes) != ("auto", 1):
        raise UsageError(
            f"devices={devices!r} x num_nodes={num_nodes} = {world} processes, but the launcher started "
            f"{env.world_size}: make them agree (or pass devices='auto')"
        )
    if env is not None and (devices, num_nodes) == ("auto", 1):
        world = env.world_size
    kwargs = {} if precision is None else {"precision": precision}
    if world == 1 and strategy != "ddp":
        device = torch.device("cuda", ids[0]) if device_type == "cuda" else torch.device("cpu")
        return SingleDeviceStrategy(device=device, **kwargs)
    if device_type == "cuda":  # listed GPUs: local rank i runs on ids[i] (devices=[2, 3]: GPUs 2 and 3)
        return Parallel3DStrategy(dp=world, backend="nccl", device_ids=ids if listed else None, **kwargs)
    return Parallel3DStrategy(dp=world, backend="gloo", **kwargs)


def planned_processes(strategy: Strategy) -> int:
    """How many processes `strategy` runs, known before it starts them (it reports a world of 1
    until then): what ``trainer.num_devices`` x ``num_nodes`` is from construction on, as
    Lightning's ``len(trainer.device_ids)`` is for ``devices=N``."""
    if strategy.world_size > 1 or not isinstance(strategy, Parallel3DStrategy):
        return strategy.world_size
    cfg = strategy.config
    if cfg.dp == "auto":
        env = detect_environment()
        return env.world_size if env is not None else cfg.replica_ranks
    return cfg.replica_ranks * int(cfg.dp)


# ---- callbacks, loggers, determinism --------------------------------------------------
def build_callbacks(
    callbacks: Any, checkpointing: bool, progress_bar: bool, summary: bool, max_time_s: float | None = None
) -> list[Callback]:
    """The user's callbacks plus the defaults (ModelCheckpoint, progress bar, model summary, and, as
    Lightning, a step-interval `Timer` for ``max_time`` unless the callbacks hold a Timer already)."""
    cbs = [callbacks] if isinstance(callbacks, Callback) else list(callbacks or [])
    bad = [type(c).__name__ for c in cbs if not isinstance(c, Callback)]
    if bad:
        raise UsageError(f"callbacks must be nanolight Callback instances, got {bad}")
    has_ckpt = any(isinstance(cb, ModelCheckpoint) for cb in cbs)
    if not checkpointing and has_ckpt:
        raise UsageError("enable_checkpointing=False but callbacks holds a ModelCheckpoint: drop one of them")
    if checkpointing and not has_ckpt:
        cbs.append(ModelCheckpoint())
    if progress_bar and not any(isinstance(cb, RichProgressBar) for cb in cbs):
        cbs.append(RichProgressBar())
    if summary and not any(isinstance(cb, ModelSummary) for cb in cbs):
        cbs.append(ModelSummary())
    if max_time_s is not None:
        if any(isinstance(cb, Timer) for cb in cbs):
            rank_zero_info("callbacks list already contains a Timer: max_time is ignored")
        else:
            cbs.append(Timer(duration=datetime.timedelta(seconds=max_time_s), interval="step"))
    return order_callbacks(cbs)


def build_loggers(logger: Any, default_root_dir: str | Path, fast_dev_run: bool) -> list[Logger]:
    """None/True -> a CSVLogger under the root dir (Lightning's default without TensorBoard);
    False -> none (fast_dev_run logs nothing either)."""
    if fast_dev_run or logger is False:
        return []
    if logger is None or logger is True:
        return [CSVLogger(save_dir=default_root_dir)]
    loggers = [logger] if isinstance(logger, Logger) else list(logger)
    bad = [type(lg).__name__ for lg in loggers if not isinstance(lg, Logger)]
    if bad:
        raise UsageError(f"logger must be a nanolight Logger (or a list of them), got {bad}")
    for lg in loggers:
        lg.set_default_save_dir(default_root_dir)
    return loggers


@contextmanager
def set_determinism(deterministic: bool | str | None, benchmark: bool | None) -> Iterator[None]:
    """``deterministic`` (True, or "warn": warn only) and cudnn ``benchmark`` for one call;
    both are process-global, so they are restored afterwards."""
    was_det, was_warn = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    was_bench = torch.backends.cudnn.benchmark
    if deterministic not in (None, False, True, "warn"):
        raise UsageError(f'deterministic must be True, False, "warn" or None, got {deterministic!r}')
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=deterministic == "warn")
    if benchmark is not None:
        torch.backends.cudnn.benchmark = benchmark and not deterministic
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_det, warn_only=was_warn)
        torch.backends.cudnn.benchmark = was_bench
