"""`+parallel=auto`: the recipe runs the planner's fastest layout that fits, and checks its prediction.

The world is the one the run is launched in: torchrun/srun's, else `+cluster.gpus` (default: the
visible GPUs, 1 on CPU) local processes. The hardware is `+cluster.gpu`, else the visible GPU's
entry in the planner's table, else `cpu` measured now. The workload is the recipe's model and
`trainer.seq_len`; the global batch is `trainer.micro_batch_size * trainer.accumulate_grad_batches`
sequences. Knobs named on the command line (`PINNABLE`) are pinned, the rest searched -- but for
`trainer.accumulate_grad_batches`, which sizes the global batch that the pick splits as
micro-batch x accumulation x dp. The pick becomes the recipe's own keys (`apply_layout`), so the
run is the one the printed command line runs.

The pick is made once: under plain python the launching process plans and hands the pick to the
ranks it starts through `AUTO_ENV` (the CPU's calibration is a measurement: planned again, a rank
could pick another layout). Under torchrun/srun every rank plans alike from the GPU table; on CPU
they would not, so there `+parallel=auto` asks for plain python instead.

`PredictionCheck` measures the run: the median optimizer-step time (validation excluded; timed over
each logging interval by `StepTimer`, so no step between logging steps syncs the device) and the
peak memory of the most loaded rank -- `torch.cuda.max_memory_allocated` on a GPU; on CPU the
process's peak resident set growth over training (`VmHWM`, reset at the start, minus the resident
set then), which also counts the allocator's slack and torch's lazily loaded code, so it reads
above the planner's tracked parts for small models.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from typing import Any

import torch
import torch.distributed as dist

from nanolight.callbacks.throughput import StepTimer
from nanolight.errors import UsageError
from nanolight.parallel.config import ParallelConfig
from nanolight.parallel.environment import detect_environment
from nanolight.planner.hardware import Hardware, at_hand, hardware, table_name
from nanolight.planner.layout import Layout
from nanolight.planner.memory import Workload
from nanolight.planner.search import Prediction, no_fit_message, plan
from nanolight.pretrain.config import PretrainConfig

AUTO_ENV = "NANOLIGHT_AUTO_LAYOUT"  # the launching process's pick, as JSON, for the ranks it starts
# the recipe's section -> the Layout fields it holds (under the same names)
LAYOUT_KEYS = {
    "parallel": ParallelConfig.knobs(),
    "trainer": ("micro_batch_size", "accumulate_grad_batches", "precision", "activation_checkpointing"),
}
PINNABLE = {f"{section}.{name}": name for section, names in LAYOUT_KEYS.items() for name in names}


def pinned_knobs(config: PretrainConfig, overrides: list[str]) -> dict[str, Any]:
    """The layout knobs the command line names, at their validated values (`precision=auto` is not a pin)."""
    pinned = {}
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key in PINNABLE:
            section, name = key.split(".")
            pinned[PINNABLE[key]] = getattr(getattr(config, section), name)
    if pinned.get("precision") == "auto":
        del pinned["precision"]
    return pinned


def launched_world(config: PretrainConfig) -> int:
    """torchrun/srun's world size (which `+cluster.gpus` must then match), else the local processes."""
    gpus, env = config.cluster.gpus, detect_environment()
    if env is not None and env.source != "subprocess":
        if gpus is not None and gpus != env.world_size:
            raise UsageError(
                f"+cluster.gpus={gpus} but {env.source} started {env.world_size} processes; drop +cluster.gpus "
                "or launch that many"
            )
        return env.world_size
    if gpus is not None:
        return gpus
    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def local_hardware(config: PretrainConfig) -> Hardware:
    """`+cluster.gpu`, else the visible GPU's table entry, else this CPU, measured. The visible
    GPU's entry gets the host's cost per block measured on it (`hardware.at_hand`) where one
    process plans: under torchrun/srun every rank plans, and measurements would differ."""
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if cuda else None
    visible = table_name(device) if device is not None else None
    name = config.cluster.gpu
    if name is None and not cuda:
        return hardware("cpu")
    if name is None and visible is None:
        raise UsageError(
            f"the planner has no figures for this GPU ({device}); name the nearest with +cluster.gpu=<h100-sxm|"
            "h100-pcie|h200|a100-40gb|a100-80gb|b200>"
        )
    if name is not None and name != "cpu" and not cuda:
        raise UsageError(
            f"+cluster.gpu={name} but this machine has no GPU: the run would be on its CPU; drop "
            "+cluster.gpu (the CPU is measured), or plan for that GPU with scripts/plan.py"
        )
    name = name or visible
    if name == visible and detect_environment() is None:
        return at_hand(hardware(name), torch.device("cuda", torch.cuda.current_device()))
    return hardware(name)


def choose_layout(config: PretrainConfig, world: int, hw: Hardware, pinned: dict[str, Any]) -> Prediction:
    """`search.plan`'s best layout of `world` ranks for the recipe's workload; none fitting is one line."""
    t = config.trainer
    batch_tokens = t.micro_batch_size * t.accumulate_grad_batches * t.seq_len
    work = Workload(config.model, t.seq_len, hw.device)
    predictions = plan(work, world, batch_tokens, hw, pinned)
    if not predictions[0].fits:
        raise UsageError(no_fit_message(predictions, hw, world, t.seq_len))
    return predictions[0]


def apply_layout(config: PretrainConfig, layout: Layout) -> PretrainConfig:
    """The config that runs `layout`: its degrees in `parallel`, its batch split and modes in `trainer`."""
    sections = {
        section: dataclasses.replace(getattr(config, section), **{n: getattr(layout, n) for n in names})
        for section, names in LAYOUT_KEYS.items()
    }
    out = dataclasses.replace(config, **sections)
    out.auto_parallel = True
    return out


def encode_prediction(p: Prediction) -> str:
    """A pick as `AUTO_ENV` carries it (JSON)."""
    return json.dumps(dataclasses.asdict(p))  # the layout as its own dict of fields


def decode_prediction(text: str) -> Prediction:
    d = json.loads(text)
    return Prediction(**{**d, "layout": Layout(**d["layout"])})


def size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


def auto_layout(config: PretrainConfig, overrides: list[str]) -> tuple[PretrainConfig, Prediction]:
    """Pick (or, in a rank this process's launcher started, receive) the layout; print it once."""
    handed = os.environ.get(AUTO_ENV)
    env = detect_environment()
    if handed is not None and env is not None and env.source == "subprocess":
        best = decode_prediction(handed)
        return apply_layout(config, best.layout), best
    world = launched_world(config)
    if env is not None and not torch.cuda.is_available():
        # each rank would measure the CPU itself, and measurements differ: the ranks could disagree
        raise UsageError(
            f"+parallel=auto on CPU plans in one process: start plain python with +cluster.gpus={world} "
            f"instead of {env.source} (it starts the ranks and hands them its pick)"
        )
    hw = local_hardware(config)
    pinned = pinned_knobs(config, overrides)
    pinned.pop("accumulate_grad_batches", None)  # here it sizes the global batch, which dp may split
    best = choose_layout(config, world, hw, pinned)
    os.environ[AUTO_ENV] = encode_prediction(best)  # inherited by the ranks a plain-python launch starts
    if env is None or env.rank == 0:
        print(
            f"nanolight: +parallel=auto on {world} x {hw.name}: {best.layout.overrides()} -- predicted peak "
            f"{size(best.memory_bytes['total'])} per rank, step {best.step_time_s:.4g} s",
            flush=True,
        )
    return apply_layout(config, best.layout), best


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


class PredictionCheck(StepTimer):
    """At the end of training, rank 0 prints the prediction beside what the run measured."""

    def __init__(self, prediction: Prediction) -> None:
        super().__init__()
        self.prediction = prediction
        self._times: list[float] = []  # seconds per step, one entry per logging interval
        self._rss0 = 0
        # (peak bytes of the most loaded rank, median step seconds or None), once training ended
        self.measured: tuple[int, float | None] | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # before the model is built: its parameters, gradients and optimizer state count in the growth
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        else:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # Linux: reset the peak resident set (VmHWM) to the current one
            except OSError:
                pass  # the peak then counts from the process's start: an upper bound
            self._rss0 = _rss_kb("VmRSS") * 1024

    def on_timed(self, trainer: Any, seconds: float, steps: int) -> None:
        self._times.append(seconds / steps)

    def measured_peak(self, device: torch.device) -> tuple[int, str]:
        """This rank's peak bytes, and what they are."""
        if device.type == "cuda":
            return torch.cuda.max_memory_allocated(device), "max_memory_allocated"
        return _rss_kb("VmHWM") * 1024 - self._rss0, "peak RSS growth"

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        device = trainer.strategy.root_device
        peak, kind = self.measured_peak(device)
        if dist.is_available() and dist.is_initialized():
            most = torch.tensor([peak], dtype=torch.int64, device=device)
            dist.all_reduce(most, op=dist.ReduceOp.MAX)  # every rank sends its peak; all get the largest
            peak = int(most.item())
        median = statistics.median(self._times) if self._times else None
        self.measured = (peak, median)
        if not trainer.is_global_zero:
            return
        p = self.prediction
        step = f"{median:.4g} s (median of {len(self._times)})" if median is not None else "n/a"
        print(
            f"nanolight: +parallel=auto predicted vs measured: peak per rank {size(p.memory_bytes['total'])} vs "
            f"{size(peak)} ({kind}, most loaded rank); step {p.step_time_s:.4g} s vs {step}",
            flush=True,
        )


__all__ = [
    "AUTO_ENV",
    "PINNABLE",
    "PredictionCheck",
    "apply_layout",
    "auto_layout",
    "choose_layout",
    "pinned_knobs",
]
