"""Which GPU each rank takes, and what NCCL is told, checked on CPU with CUDA faked.

CUDA's rule, emulated: ``set_device(i)`` with i outside the visible devices is an invalid
ordinal. SLURM's ``--gpus-per-task=1`` shows each task only its own GPU (CUDA_VISIBLE_DEVICES
holds one id), so every task sees one device, index 0, whatever its SLURM_LOCALID. The process
group's creation is stopped right after `init_process_group` is called, with its arguments kept.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from nanolight.errors import UsageError
from nanolight.parallel.environment import detect_environment
from nanolight.parallel.health import KEY, Heartbeat, PeerError
from nanolight.parallel.launcher import NCCL_DEBUG_DEFAULTS, init_distributed, nccl_dumps
from nanolight.trainer.arguments import resolve_strategy

LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NANOLIGHT_LAUNCHER_PARENT_PID",
)
NCCL_VARS = [name for names, _ in NCCL_DEBUG_DEFAULTS for name in names]


class Joined(Exception):
    """Raised by the fake `init_process_group`: the test has seen what it needed."""


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """`visible` CUDA devices (set by the test), `set_device` calls and `init_process_group` kwargs."""
    seen: dict[str, Any] = {"visible": 1, "set_device": [], "init": None}

    def set_device(index: int) -> None:
        if not 0 <= index < seen["visible"]:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index} ({seen['visible']} visible)")
        seen["set_device"].append(index)

    def init_process_group(backend: str, **kwargs: Any) -> None:
        seen["init"] = {"backend": backend, **kwargs}
        raise Joined

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: seen["visible"])
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    for name in (*LAUNCH_VARS, *NCCL_VARS):
        # set first, so that monkeypatch records the original and undoes what the launcher sets
        # (the flight recorder's variables would otherwise leak into later tests' subprocesses)
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    for name in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    return seen


def _slurm_task(monkeypatch: pytest.MonkeyPatch, procid: int, localid: int, ntasks: int = 16) -> None:
    """What srun sets in task `procid` of a 2-node step, 8 tasks and 8 GPUs per node, one GPU per task."""
    for key, value in {
        "SLURM_PROCID": procid, "SLURM_LOCALID": localid, "SLURM_NTASKS": ntasks, "SLURM_STEP_NUM_TASKS": ntasks,
        "SLURM_NODELIST": "gpu[001-002]", "SLURM_STEP_NODELIST": "gpu[001-002]", "SLURM_JOB_ID": 4242,
        "SLURM_NTASKS_PER_NODE": 8, "SLURM_GPUS_PER_TASK": 1, "CUDA_VISIBLE_DEVICES": localid, "MASTER_ADDR": "gpu001",
    }.items():  # fmt: skip
        monkeypatch.setenv(key, str(value))


def test_slurm_one_gpu_per_task_takes_its_only_device(
    fake_cuda: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    _slurm_task(monkeypatch, procid=13, localid=5)
    env = detect_environment()
    assert (env.source, env.rank, env.local_rank) == ("slurm", 13, 5)
    with pytest.raises(Joined):
        init_distributed(env, "nccl", timedelta(seconds=77))
    assert fake_cuda["set_device"] == [0]
    init = fake_cuda["init"]
    assert init["backend"] == "nccl"
    assert init["device_id"] == torch.device("cuda", 0)  # eager NCCL init, on the task's GPU
    assert init["timeout"] == timedelta(seconds=77)  # the watchdog's timeout is +parallel.timeout_s


def test_slurm_with_every_gpu_visible_takes_the_local_id(
    fake_cuda: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    _slurm_task(monkeypatch, procid=13, localid=5)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    fake_cuda["visible"] = 8
    with pytest.raises(Joined):
        init_distributed(detect_environment(), "nccl")
    assert fake_cuda["set_device"] == [5] and fake_cuda["init"]["device_id"] == torch.device("cuda", 5)


def test_torchrun_local_rank_beyond_the_visible_gpus_is_one_line(
    fake_cuda: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in {"RANK": 2, "WORLD_SIZE": 3, "LOCAL_RANK": 2, "MASTER_PORT": 1}.items():
        monkeypatch.setenv(key, str(value))
    fake_cuda["visible"] = 2
    with pytest.raises(
        UsageError, match=r"rank 2 would use CUDA device 2 but 2 are visible.*at most 2 processes"
    ):
        init_distributed(detect_environment(), "nccl")


def test_devices_list_is_honoured_by_each_process(fake_cuda: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """``NanoTrainer(accelerator="gpu", devices=[2, 3])`` as rank 1 of the two processes."""
    for key, value in {"RANK": 1, "WORLD_SIZE": 2, "LOCAL_RANK": 1, "MASTER_PORT": 1}.items():
        monkeypatch.setenv(key, str(value))
    monkeypatch.setattr("nanolight.parallel.launcher.watch_launcher", lambda *a, **k: None)
    fake_cuda["visible"] = 4
    strategy = resolve_strategy("auto", "gpu", [2, 3], 1, None)
    with pytest.raises(Joined):
        strategy.setup_environment()
    assert fake_cuda["set_device"] == [3] and fake_cuda["init"]["device_id"] == torch.device("cuda", 3)


def test_nccl_flight_recorder_is_on_unless_the_user_chose(
    fake_cuda: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    _slurm_task(monkeypatch, procid=1, localid=1)
    with pytest.raises(Joined):
        init_distributed(detect_environment(), "nccl")
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert int(os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0 and int(os.environ["TORCH_FR_BUFFER_SIZE"]) > 0
    assert os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"].endswith("nanolight_nccl_trace_rank_")
    # the user's choices stand, under either of torch's names
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "50")
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE")
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", "/scratch/fr_")
    monkeypatch.delenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    with pytest.raises(Joined):
        init_distributed(detect_environment(), "nccl")
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "50" and "TORCH_FR_BUFFER_SIZE" not in os.environ
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == "/scratch/fr_"
    assert "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in os.environ


def test_stopped_peer_message_says_where_the_nccl_dump_is() -> None:
    """The one line a rank prints when a collective times out names the silent rank and the dump."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        host, number = probe.getsockname()
    store = dist.TCPStore(host, number, is_master=True, timeout=timedelta(seconds=10))
    store.set(KEY.format(1), repr(time.time() - 100))  # rank 1 fell silent 100 s ago
    beat = Heartbeat(host, number, rank=0, world_size=2, trace="/scratch/nccl_trace_rank_")
    try:
        message = str(PeerError.of(RuntimeError("Timed out waiting 600000ms"), "the forward", beat))
    finally:
        beat.close()
    assert "rank 1 stopped answering" in message
    assert "/scratch/nccl_trace_rank_<rank>" in message and "/scratch/nccl_trace_rank_0" in message
    assert "\n" not in message


def test_launcher_names_the_dumps_written_by_this_run(tmp_path: Path) -> None:
    prefix = str(tmp_path / "trace_rank_")
    (tmp_path / "trace_rank_0").write_text("old")
    started = time.time() + 5  # rank 0's file predates the run: not this run's
    (tmp_path / "trace_rank_1").write_text("new")
    os.utime(tmp_path / "trace_rank_1", (started + 1, started + 1))
    assert nccl_dumps(3, started, {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix}) == [prefix + "1"]
