"""Lightning's ``accelerator`` / ``devices`` / ``num_nodes`` / ``strategy`` arguments -> a `Strategy`.

``devices=N`` (or N x ``num_nodes``) processes mean data parallelism, as Lightning's DDP: under
plain ``python script.py`` the script is re-launched as N local processes
(`nanolight/parallel/launcher.py`), under torchrun/srun the processes exist already. One process
is `SingleDeviceStrategy`; tensor and pipeline parallelism are asked for explicitly, with
``strategy=Parallel3DStrategy(tp=..., pp=...)``.
"""

from __future__ import annotations

from typing import Any

import torch

from nanolight.errors import UsageError
from nanolight.parallel.environment import detect_environment
from nanolight.precision import Precision
from nanolight.strategies.base import Strategy
from nanolight.strategies.parallel3d import Parallel3DStrategy
from nanolight.strategies.single_device import SingleDeviceStrategy

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
            f"strategy={strategy!r} is not supported" + (f": {why}" if why else "")
            + "; use 'auto', 'ddp', or a nanolight Strategy (e.g. Parallel3DStrategy(tp=2))"
        )  # fmt: skip
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
        return env.world_size if env is not None else cfg.tp * cfg.pp
    return cfg.tp * cfg.pp * int(cfg.dp)
