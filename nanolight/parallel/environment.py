"""Where this process sits in a distributed run, read from whoever started it.

    torchrun ... script.py        RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT
    srun ... python script.py     SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID; the master is the
                                  first host of the step's node list
    python script.py              nobody: `launcher.SubprocessLauncher` re-runs the script as N
                                  children with the torchrun variables (and `PARENT_PID_VAR`) set

Reading those variables is this file's job alone; the rest of nanolight receives a `ProcessEnv`
(or a `ParallelContext`) and never looks at the environment.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

PARENT_PID_VAR = "NANOLIGHT_LAUNCHER_PARENT_PID"  # set on our children: "exit if I am orphaned"
STOP_REASON_VAR = "NANOLIGHT_STOP_REASON"  # set by a rank on itself: why the SIGTERM it sent itself


@dataclass(frozen=True)
class ProcessEnv:
    """Where this process sits in the run, and where the rendezvous is."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun" | "slurm" | "subprocess" | "single"


def free_port() -> int:
    """A TCP port free on this machine right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list ("gpu[003-005,009],cpu1" -> "gpu003")."""
    scontrol = shutil.which("scontrol")
    if scontrol:
        try:
            out = subprocess.run(
                [scontrol, "show", "hostnames", nodelist],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            ).stdout.split()
            if out:
                return out[0]
        except (subprocess.SubprocessError, OSError):
            pass  # fall back to parsing the compressed list ourselves
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise ValueError(f"cannot parse SLURM node list {nodelist!r}; set MASTER_ADDR explicitly")
    prefix, ranges = match.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def launched_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's global rank as its launcher set it (torchrun's RANK, else srun's
    SLURM_PROCID), 0 when nothing launched it. For what needs a rank before any strategy knows
    it -- rank-zero printing from ``import nanolight`` on -- so it asks nothing else (no node
    list, no rendezvous): `detect_environment` is the whole answer."""
    env = os.environ if environ is None else environ
    return int(env.get("RANK", env.get("SLURM_PROCID", 0)))


def detect_environment(environ: Mapping[str, str] | None = None) -> ProcessEnv | None:
    """The `ProcessEnv` set up by torchrun, SLURM or our own launcher; None under plain python."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return ProcessEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", "29500")),
            source="subprocess" if PARENT_PID_VAR in env else "torchrun",
        )
    ntasks = int(env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "1")))
    if "SLURM_PROCID" in env and ntasks > 1:  # under srun (a batch script's shell has 1 task)
        nodelist = env.get("SLURM_STEP_NODELIST", env.get("SLURM_NODELIST", "127.0.0.1"))
        job_id = int(env.get("SLURM_JOB_ID", "0"))
        return ProcessEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=ntasks,
            local_rank=int(env.get("SLURM_LOCALID", "0")),
            master_addr=env.get("MASTER_ADDR") or first_slurm_host(nodelist),
            # same port on every task of the job, different across jobs sharing a node
            master_port=int(env.get("MASTER_PORT", 15000 + job_id % 20000)),
            source="slurm",
        )
    return None
