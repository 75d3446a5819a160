"""Make sure the processes of a distributed run exist, then join them into one world.

Under torchrun or srun the processes exist (`environment.py` reads where this one sits). Under
plain ``python script.py`` with a world of N, `SubprocessLauncher` re-runs the same command line
as N local children (as Lightning's launcher does for ``devices=N``), waits for them and exits
with their status:

* one child failing stops the others at once, so a crashed rank never leaves its peers blocked;
* SIGTERM/SIGUSR1 to the parent (pre-emption) are passed on, and the parent keeps waiting while
  the children finish their step and save (``nanolight/trainer/preemption.py``); so is a first Ctrl-C
  (the children run in their own process groups, so the terminal's reaches the parent alone), and
  a second one kills them at once;
* each child gets ``cores // N`` threads (``OMP_NUM_THREADS``) unless the user set it: N ranks
  of torch's default (every core each) oversubscribe the machine several times over.

A worker whose launcher died (ours, or torchrun's agent) stops by itself: `watch_launcher` sees
its parent change, signals itself SIGTERM -- the pre-emption path: finish the step, save, exit --
and exits hard if that has not happened within a grace period.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, MutableMapping, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from nanolight.errors import NanolightError, UsageError
from nanolight.parallel.environment import (
    PARENT_PID_VAR,
    STOP_REASON_VAR,
    ProcessEnv,
    detect_environment,
    free_port,
)
from nanolight.parallel.health import Heartbeat


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
        self.started = 0.0  # when the children were started (dump files older than that are stale)
        self.interrupts = 0  # Ctrl-C presses seen while the children run

    def command(self) -> list[str]:
        cmd = _script_command()
        return cmd + _hydra_overrides(cmd)

    def threads_per_rank(self) -> int | None:
        """``cores // ranks`` (at least 1) unless the user chose ``OMP_NUM_THREADS``."""
        if "OMP_NUM_THREADS" in os.environ:
            return None
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return max(1, cores // self.world_size)

    def child_env(self, rank: int, port: int) -> dict[str, str]:
        env = dict(os.environ)
        threads = self.threads_per_rank()
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
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
        threads = self.threads_per_rank()
        if threads is not None:
            print(
                f"nanolight: {self.world_size} local ranks, {threads} thread(s) each (OMP_NUM_THREADS; set it to "
                "choose another count)",
                file=sys.stderr,
            )
        self.started, self.interrupts = time.time(), 0
        # each child in a process group of its own: a terminal's Ctrl-C reaches the parent only, which
        # passes each press on once (from the terminal too, a rank would see two and stop unsaved)
        children = [
            subprocess.Popen(cmd, env=self.child_env(r, port), **_OWN_GROUP) for r in range(self.world_size)
        ]
        # Pre-emption (SIGTERM, SLURM's SIGUSR1) must reach the children, which finish their step,
        # save and exit 0: pass it on and keep waiting. Ctrl-C: the first is passed on (the recipe's
        # ranks save and exit 130), the second ends them at once (`_wait`).
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in _FORWARDED_SIGNALS:
                previous[sig] = signal.signal(sig, lambda signum, frame: _forward(children, signum))
            previous[signal.SIGINT] = signal.signal(
                signal.SIGINT, lambda signum, frame: self._interrupt(children)
            )
        try:
            return self._wait(children)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._stop(children)

    def _interrupt(self, children: list[subprocess.Popen]) -> None:
        self.interrupts += 1
        if self.interrupts == 1:
            _forward(children, signal.SIGINT)

    def _wait(self, children: list[subprocess.Popen]) -> int:
        while True:
            codes = [c.poll() for c in children]
            if self.interrupts > 1:  # Ctrl-C twice: the user will not wait for a save
                for child in children:
                    child.kill()
                print("nanolight: Ctrl-C again: stopped every rank at once, nothing saved", file=sys.stderr)
                return 130
            done = (0, 130) if self.interrupts else (0,)  # 130: a rank stopped by Ctrl-C, as asked
            failed = [code for code in codes if code not in (None, *done)]
            if failed:  # a dead rank: its peers would block in the next collective; stop them
                code = failed[0]
                rank = codes.index(code)
                dumps = nccl_dumps(self.world_size, self.started)
                print(
                    f"[nanolight launcher] rank {rank} (pid {children[rank].pid}) {_exit_words(code)}; "
                    "stopping the others"
                    + (f" (NCCL's flight recorder dumped {', '.join(dumps)})" if dumps else ""),
                    file=sys.stderr,
                )
                return code if code > 0 else 128 - code  # killed by signal N -> 128 + N
            if all(code in done for code in codes):
                return max(codes)  # 130 once a Ctrl-C stopped the ranks
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


_OWN_GROUP: dict = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
_FORWARDED_SIGNALS = [getattr(signal, name) for name in ("SIGTERM", "SIGUSR1") if hasattr(signal, name)]


def _exit_words(code: int) -> str:
    """How a child ended, in words: a negative status is the signal that killed it."""
    if code >= 0:
        return f"exited with {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    hint = " (sent by a user, a scheduler or the out-of-memory killer)" if name == "SIGKILL" else ""
    return f"was killed by {name}{hint}"


def _forward(children: list[subprocess.Popen], signum: int) -> None:
    for child in children:
        child.send_signal(signum)  # a no-op for a child that already exited


def watch_launcher(parent_pid: int, rank: int, grace_s: float = 120.0, poll_s: float = 1.0) -> None:
    """When the process that started this worker (our launcher, torchrun's agent) is gone, stop:
    SIGTERM to ourselves (in `fit`: finish the step, save, exit), then exit after `grace_s`."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        reason = f"the launcher (pid {parent_pid}) is gone"
        print(f"nanolight: rank {rank}: {reason}; saving and stopping", file=sys.stderr)
        os.environ[STOP_REASON_VAR] = reason  # the pre-emption's line names it, not a SIGTERM nobody sent
        signal.raise_signal(signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(1)

    threading.Thread(target=watch, name="nanolight-launcher-watch", daemon=True).start()


def ensure_processes(world_size: int) -> ProcessEnv:
    """Return this process's `ProcessEnv`, creating the processes first if nobody did.

    Under torchrun/SLURM the world size is given and must equal `world_size`. Under plain
    python with `world_size > 1` the current process becomes the launcher: it re-runs the
    script as `world_size` children and exits with their status (this call never returns).
    """
    env = detect_environment()
    if env is not None:
        if env.world_size != world_size:
            raise UsageError(
                f"the launcher ({env.source}) started {env.world_size} processes but the parallel layout "
                f"needs tp*pp*dp = {world_size}; launch {world_size} processes or change the layout"
            )
        if env.source == "subprocess":
            watch_launcher(int(os.environ[PARENT_PID_VAR]), env.rank)
        elif env.source == "torchrun":
            watch_launcher(os.getppid(), env.rank)  # torchrun's agent
        return env
    if world_size == 1:
        return ProcessEnv(0, 1, 0, "127.0.0.1", free_port(), "single")
    sys.exit(SubprocessLauncher(world_size).launch())


def cuda_device_index(env: ProcessEnv, device_ids: Sequence[int] | None = None) -> int:
    """This process's CUDA device, among the devices it sees.

    ``devices=[2, 3]`` (`device_ids`): local rank i takes ``device_ids[i]``. Otherwise local rank
    i takes device i -- except under SLURM, where ``--gpus-per-task=1`` shows each task only its
    own GPU, as device 0, whatever its SLURM_LOCALID: there the index is the local rank modulo the
    visible count (with every GPU of the node visible, the same as the local rank).
    """
    count = torch.cuda.device_count()
    if device_ids:
        if env.local_rank >= len(device_ids):
            raise UsageError(
                f"local rank {env.local_rank} but devices={list(device_ids)} names {len(device_ids)} GPUs: "
                f"start {len(device_ids)} processes per node or list one GPU per process"
            )
        index = int(device_ids[env.local_rank])
    elif env.source == "slurm" and count > 0:
        index = env.local_rank % count
    else:
        index = env.local_rank
    if not 0 <= index < count:
        raise UsageError(
            f"rank {env.rank} would use CUDA device {index} but {count} are visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): start at most {count} "
            "processes per node, or give devices=[...] that exist"
        )
    return index


# NCCL's flight recorder: the last collectives of each rank, dumped to a file when the watchdog sees
# a timeout. Each entry: the names torch reads (newer first; a user's choice under any of them
# stands), and nanolight's default.
TRACE_FILE_VARS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
NCCL_DEBUG_DEFAULTS: list[tuple[tuple[str, ...], str]] = [
    (("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"), "2000"),
    (("TORCH_NCCL_DUMP_ON_TIMEOUT",), "1"),
    (TRACE_FILE_VARS, os.path.join(tempfile.gettempdir(), "nanolight_nccl_trace_rank_")),
]


def set_nccl_debug_env(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Turn NCCL's flight recorder on where the user has not chosen (before the NCCL group exists:
    torch reads these once, when it builds it); returns the dump files' prefix (+ the rank), or
    None when the user switched the dump off. `environ`: the process's, read at the call."""
    environ = os.environ if environ is None else environ
    for names, default in NCCL_DEBUG_DEFAULTS:
        if not any(name in environ for name in names):
            for name in names:
                environ[name] = default
    if environ.get("TORCH_NCCL_DUMP_ON_TIMEOUT", "1") in ("0", "false", "False"):
        return None
    return next(environ[name] for name in TRACE_FILE_VARS if name in environ)


def nccl_dumps(world_size: int, since: float, environ: Mapping[str, str] | None = None) -> list[str]:
    """The flight-recorder dump files written since `since` (after an NCCL timeout), for the
    launcher's last line."""
    environ = os.environ if environ is None else environ
    prefix = next((environ[name] for name in TRACE_FILE_VARS if name in environ), NCCL_DEBUG_DEFAULTS[-1][1])
    files = [f"{prefix}{r}" for r in range(world_size)]
    return [f for f in files if os.path.exists(f) and os.path.getmtime(f) >= since]


def init_distributed(
    env: ProcessEnv,
    backend: str | None = None,
    timeout: timedelta = timedelta(minutes=10),
    device_ids: Sequence[int] | None = None,
) -> Heartbeat | None:
    """Join the default process group (NCCL on GPU, gloo on CPU); returns this rank's heartbeat.

    `timeout` bounds both the wait for the other ranks to join (after 10 s of waiting a line says
    who waits for whom) and every later collective -- under NCCL it is the watchdog's timeout --
    so a dead or stopped peer ends the job. Under NCCL the rank's device (`cuda_device_index`) is
    given as ``device_id``: the communicator is created at once, on that device (eager init), not
    lazily per operation; and the flight recorder is on (`set_nccl_debug_env`).
    """
    if dist.is_initialized():
        return None
    if not faulthandler.is_enabled():
        # a rank that dies of a signal (a C++ abort in a communication library, a segfault) prints
        # every thread's Python stack before it goes: the launcher's "rank N exited with -6" alone
        # says nothing of where
        faulthandler.enable(all_threads=True)
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    options: dict = {}
    trace = None
    if backend == "nccl":
        index = cuda_device_index(env, device_ids)
        torch.cuda.set_device(index)
        options["device_id"] = torch.device("cuda", index)
        trace = set_nccl_debug_env()
    where = f"{env.master_addr}:{env.master_port}"
    waiting = (
        f"nanolight: rank {env.rank} of {env.world_size} waiting for the other ranks at {where} "
        f"(gives up after {timeout.total_seconds():.0f} s: +parallel.timeout_s)"
    )
    notice = threading.Timer(10.0, lambda: print(waiting, file=sys.stderr, flush=True))
    notice.daemon = True
    notice.start()
    try:
        if env.source == "torchrun":  # torchrun's agent hosts the store on MASTER_PORT: env:// joins it
            dist.init_process_group(backend, init_method="env://", timeout=timeout, **options)
        else:
            dist.init_process_group(
                backend,
                init_method=f"tcp://{where}",
                rank=env.rank,
                world_size=env.world_size,
                timeout=timeout,
                **options,
            )
    except (RuntimeError, dist.DistError) as exc:
        raise NanolightError(
            f"rank {env.rank} of {env.world_size}: the other ranks did not join at {where} within "
            f"{timeout.total_seconds():.0f} s ({str(exc).splitlines()[0][:160]}); start every rank (under SLURM "
            "with srun, not in the batch script's own shell) or raise +parallel.timeout_s"
        ) from exc
    finally:
        notice.cancel()
    return Heartbeat(env.master_addr, env.master_port, env.rank, env.world_size, trace=trace)


def join_fake_world(rank: int, world_size: int) -> None:
    """Join torch's fake process group as rank `rank` of `world_size`: every collective returns at
    once with nothing in it, so one process plays one rank of any world (the dry run's)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
