"""Make sure the processes of a distributed run exist, then join them into one world.

Three ways a nanolight script runs with more than one process:

* `torchrun ... script.py`   torchrun set RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT;
* `srun ... python script.py` SLURM set SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID; the master is
  the first host of the step's node list;
* `python script.py`          nobody did: `SubprocessLauncher` re-runs the same command line as
  N local children with the torchrun variables set (as Lightning's launcher does for
  `devices=N`), waits for them and exits with their status. If one child fails, the parent
  kills the others at once, so a crashed rank never leaves its peers blocked in a collective.
  SIGTERM/SIGUSR1 to the parent (pre-emption) are passed on to every child, and the parent keeps
  waiting while they finish their step and save (``nanolight/trainer/preemption.py``).

Reading those variables is the launcher's job alone; the rest of nanolight receives a
`ProcessEnv` / `ParallelContext` and never looks at the environment.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

PARENT_PID_VAR = "NANOLIGHT_LAUNCHER_PARENT_PID"  # set on our children: "exit if I am orphaned"


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


def _script_command() -> list[str]:
    """The command line that started this process, for re-running it in the children."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name not in (None, "__main__"):  # python -m package.module
        name = spec.name[: -len(".__main__")] if spec.name.endswith(".__main__") else spec.name
        return [sys.executable, "-m", name, *sys.argv[1:]]
    if not sys.argv or not os.path.isfile(sys.argv[0]):  # python -c, a REPL or a notebook
        raise RuntimeError(
            f"cannot re-launch {sys.argv[:1]} as several processes: run a script file, or start the "
            "processes yourself with torchrun --nproc-per-node=N script.py"
        )
    return [sys.executable, os.path.abspath(sys.argv[0]), *sys.argv[1:]]


def _hydra_overrides(argv: list[str]) -> list[str]:
    """Under Hydra, pin the children to the parent's run directory (else each makes its own)."""
    try:
        from hydra.core.hydra_config import HydraConfig
    except ImportError:
        return []
    if not HydraConfig.initialized():
        return []
    extra = []
    if not any(a.startswith("hydra.run.dir=") for a in argv):
        extra.append(f"hydra.run.dir={HydraConfig.get().runtime.output_dir}")
    if not any(a.startswith("hydra.output_subdir=") for a in argv):
        extra.append("hydra.output_subdir=null")  # the parent already saved the config
    return extra


class SubprocessLauncher:
    """Run this script as `world_size` local processes; the parent only supervises them."""

    def __init__(self, world_size: int, grace_s: float = 5.0, poll_s: float = 0.1) -> None:
        self.world_size, self.grace_s, self.poll_s = world_size, grace_s, poll_s

    def command(self) -> list[str]:
        cmd = _script_command()
        return cmd + _hydra_overrides(cmd)

    def child_env(self, rank: int, port: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_WORLD_SIZE=str(self.world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        env[PARENT_PID_VAR] = str(os.getpid())
        return env

    def launch(self) -> int:
        """Start the children, wait, return the first failure's exit code (0 if all succeed)."""
        port, cmd = free_port(), self.command()
        children = [subprocess.Popen(cmd, env=self.child_env(r, port)) for r in range(self.world_size)]
        # Pre-emption (SIGTERM, SLURM's SIGUSR1) must reach the children, which finish their step,
        # save and exit 0: pass it on and keep waiting. Ctrl-C (SIGINT) reaches them from the
        # terminal and stops the parent with KeyboardInterrupt: `_stop` ends them.
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in _FORWARDED_SIGNALS:
                previous[sig] = signal.signal(sig, lambda signum, frame: _forward(children, signum))
        try:
            return self._wait(children)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._stop(children)

    def _wait(self, children: list[subprocess.Popen]) -> int:
        while True:
            codes = [c.poll() for c in children]
            failed = [code for code in codes if code not in (None, 0)]
            if failed:  # a dead rank: its peers would block in the next collective; stop them
                code = failed[0]
                rank = codes.index(code)
                print(
                    f"[nanolight launcher] rank {rank} exited with {code}; stopping the others",
                    file=sys.stderr,
                )
                return code if code > 0 else 128 - code  # killed by signal N -> 128 + N
            if all(code == 0 for code in codes):
                return 0
            time.sleep(self.poll_s)

    def _stop(self, children: list[subprocess.Popen]) -> None:
        for child in children:
            if child.poll() is None:
                child.terminate()
        deadline = time.monotonic() + self.grace_s
        for child in children:
            try:
                child.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


_FORWARDED_SIGNALS = [getattr(signal, name) for name in ("SIGTERM", "SIGUSR1") if hasattr(signal, name)]


def _forward(children: list[subprocess.Popen], signum: int) -> None:
    for child in children:
        child.send_signal(signum)  # a no-op for a child that already exited


def _exit_when_orphaned(parent_pid: int, poll_s: float = 1.0) -> None:
    """Children of a killed launcher must not linger: exit when the parent is gone."""

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(poll_s)

    threading.Thread(target=watch, name="nanolight-orphan-watch", daemon=True).start()


def ensure_processes(world_size: int) -> ProcessEnv:
    """Return this process's `ProcessEnv`, creating the processes first if nobody did.

    Under torchrun/SLURM the world size is given and must equal `world_size`. Under plain
    python with `world_size > 1` the current process becomes the launcher: it re-runs the
    script as `world_size` children and exits with their status (this call never returns).
    """
    env = detect_environment()
    if env is not None:
        if env.world_size != world_size:
            raise ValueError(
                f"the launcher ({env.source}) started {env.world_size} processes but the parallel layout "
                f"needs tp*pp*dp = {world_size}; launch {world_size} processes or change the layout"
            )
        if env.source == "subprocess":
            _exit_when_orphaned(int(os.environ[PARENT_PID_VAR]))
        return env
    if world_size == 1:
        return ProcessEnv(0, 1, 0, "127.0.0.1", free_port(), "single")
    sys.exit(SubprocessLauncher(world_size).launch())


def init_distributed(
    env: ProcessEnv, backend: str | None = None, timeout: timedelta = timedelta(minutes=10)
) -> None:
    """Join the default process group (NCCL on GPU, gloo on CPU) with a collective timeout.

    The timeout bounds how long a rank waits for a dead peer when no launcher supervises it.
    """
    if dist.is_initialized():
        return
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(env.local_rank)
    if env.source == "torchrun":
        # torchrun's agent already hosts the store on MASTER_PORT; env:// connects to it.
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    else:
        dist.init_process_group(
            backend,
            init_method=f"tcp://{env.master_addr}:{env.master_port}",
            rank=env.rank,
            world_size=env.world_size,
            timeout=timeout,
        )
