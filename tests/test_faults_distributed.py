"""Faults of a distributed run, as an operator meets them: threads per local rank, a rank that
waits for peers that never come, a stopped (SIGSTOP) rank, a dead launcher (ours and torchrun's
agent), a run directory some ranks cannot see, and an error printed once, not once per rank."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from _dist import pythonpath
from _tiny import TinyLM, run_distributed, token_loader
from test_recipe_e2e import BASE_OVERRIDES, REPO
from test_recipe_parallel import _children

from nanolight import NanoTrainer
from nanolight.errors import UsageError
from nanolight.parallel.environment import free_port
from nanolight.parallel.health import KEY, PID_KEY, Heartbeat, PeerError, publish_error
from nanolight.parallel.launcher import SubprocessLauncher
from nanolight.strategies.parallel3d import Parallel3DStrategy


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("nanolight-cache")


def test_each_local_rank_gets_its_share_of_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert SubprocessLauncher(4).child_env(1, 1234)["OMP_NUM_THREADS"] == "4"
    assert SubprocessLauncher(32).child_env(1, 1234)["OMP_NUM_THREADS"] == "1"  # at least one
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice wins
    assert SubprocessLauncher(4).child_env(1, 1234)["OMP_NUM_THREADS"] == "3"


def _recipe(run: Path, cache: Path, *overrides: str, env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, str(REPO / "recipes" / "smollm.py"), f"trainer.default_root_dir={run}",
           f"data.cache_dir={cache}", *BASE_OVERRIDES, "logger=csv", *overrides]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": pythonpath(REPO), **(env or {})}
    return subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=run.parent, env=env
    )


def _training(
    proc: subprocess.Popen, run: Path, ranks: int, deadline: float = 180, ready: Path | None = None
) -> list[int]:
    """Wait until the run logs steps (and has written `ready`) with all its ranks alive; returns the
    ranks' pids."""
    end = time.monotonic() + deadline
    ready = ready or run / "metrics.csv"
    while not ((run / "metrics.csv").exists() and ready.exists() and len(_children(proc.pid)) == ranks):
        assert proc.poll() is None and time.monotonic() < end, (
            proc.stderr.read() if proc.poll() else "never trained"
        )
        time.sleep(0.5)
    return _children(proc.pid)


def test_a_rank_waiting_for_absent_peers_says_so_and_gives_up(tmp_path: Path, cache_dir: Path) -> None:
    """SLURM_NTASKS=2 in a batch script's shell, without srun: this process believes it is rank 0 of 2."""
    slurm = {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_NODELIST": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    start = time.monotonic()
    proc = _recipe(tmp_path / "run", cache_dir, "+parallel.dp=2", "+parallel.timeout_s=15", env=slurm)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    assert "rank 0 of 2 waiting for the other ranks at 127.0.0.1:" in err
    assert "nanolight: error: rank 0 of 2: the other ranks did not join" in err and "srun" in err
    assert time.monotonic() - start < 60 and "Traceback" not in err


# no validation: the stop lands in the interleaved schedule's point-to-point receives
INTERLEAVED = ("+parallel.pp=2", "+parallel.pp_schedule=interleaved_1f1b", "+parallel.pp_virtual=2",
               "trainer.accumulate_grad_batches=2", "trainer.limit_val_batches=0")  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("layout", [("+parallel.tp=2",), INTERLEAVED], ids=["tp2", "pp2-interleaved"])
def test_a_stopped_rank_ends_the_job_naming_it(tmp_path: Path, cache_dir: Path, layout: tuple) -> None:
    """tp: a collective waits for the stopped rank; pp: a point-to-point receive does."""
    run = tmp_path / "run"
    proc = _recipe(run, cache_dir, "trainer.max_steps=100000", *layout, "+parallel.timeout_s=15")
    try:
        pids = _training(proc, run, 2)
        os.kill(pids[1], signal.SIGSTOP)
        stopped = time.monotonic()
        _, err = proc.communicate(timeout=90)
        assert proc.returncode != 0
        assert time.monotonic() - stopped < 15 + 20  # the timeout, plus the heartbeat lookup and the stop
        assert "nanolight: error: rank 0:" in err and "rank 1 stopped answering (no heartbeat for" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_ranks_of_a_killed_launcher_save_and_stop(tmp_path: Path, cache_dir: Path) -> None:
    run = tmp_path / "run"
    proc = _recipe(
        run, cache_dir, "trainer.max_steps=100000", "checkpoint.every_n_steps=100000", "+parallel.tp=2"
    )
    pids = _training(proc, run, 2)
    os.kill(proc.pid, signal.SIGKILL)  # the launcher dies; its ranks are orphaned
    proc.wait()
    deadline = time.monotonic() + 60
    while any(Path(f"/proc/{pid}").exists() for pid in pids):
        assert time.monotonic() < deadline, "orphaned ranks kept running"
        time.sleep(0.5)
    saved = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    assert saved, "the orphaned ranks stopped without saving"
    assert (run / "checkpoints" / "last").read_text().strip() == saved[-1]
    err = proc.stderr.read()  # nobody sent a SIGTERM: the line names what happened
    assert f"the launcher (pid {proc.pid}) is gone: finished step" in err and "SIGTERM" not in err, err


@pytest.mark.slow
def test_workers_of_a_killed_torchrun_agent_stop(tmp_path: Path, cache_dir: Path) -> None:
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           str(REPO / "recipes" / "smollm.py"), f"trainer.default_root_dir={run}", f"data.cache_dir={cache_dir}",
           *BASE_OVERRIDES, "logger=csv", "trainer.max_steps=100000", "+parallel.tp=2"]  # fmt: skip
    agent = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path,
                             env={**os.environ, "PYTHONPATH": pythonpath(REPO)})  # fmt: skip
    try:
        pids = _training(agent, run, 2, deadline=240)
        os.kill(agent.pid, signal.SIGKILL)  # as torchrun 2.13 dies of an unhandled SIGUSR1
        agent.wait()
        deadline = time.monotonic() + 60
        while any(Path(f"/proc/{pid}").exists() for pid in pids):
            assert time.monotonic() < deadline, "workers of the dead agent kept training"
            time.sleep(0.5)
        assert list((run / "checkpoints").glob("step-*")), "the workers stopped without saving"
    finally:
        for pid in _children(agent.pid):
            os.kill(pid, signal.SIGKILL)


def _unshared(rank: int, world: int, root: str) -> str:
    # Rank 0's relative run directory, broadcast to every rank, read from another working
    # directory per rank: what a node without the shared filesystem sees.
    node = Path(root) / f"node{rank}"
    node.mkdir()
    os.chdir(node)
    return _one_step_or_error(world, "run")


def _one_step_or_error(world: int, root: str) -> str:
    """One dp step in `root`: the UsageError's line, or "trained"."""
    trainer = NanoTrainer(
        use_distributed_sampler=False,  # each rank is given its own data
        max_steps=1, strategy=Parallel3DStrategy(dp=world), default_root_dir=root,
        logger=False, enable_progress_bar=False,
    )  # fmt: skip
    try:
        trainer.fit(TinyLM(), train_dataloaders=token_loader(8))
    except UsageError as err:
        return str(err)
    return "trained"


def test_a_run_directory_not_shared_by_every_rank_is_found_at_start(tmp_path: Path) -> None:
    errors = run_distributed(_unshared, 2, str(tmp_path), timeout=120)
    assert "rank 1 does not see the run directory" in errors[1] and "every node shares" in errors[1]
    assert "not every rank sees it" in errors[0]
    assert not list(tmp_path.rglob("step-*"))  # found before any training step


@pytest.mark.slow
def test_torchrun_prints_a_layout_error_once(tmp_path: Path, cache_dir: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=3", f"--master_port={free_port()}",
           str(REPO / "recipes" / "smollm.py"), f"trainer.default_root_dir={tmp_path / 'run'}",
           f"data.cache_dir={cache_dir}", *BASE_OVERRIDES, "+parallel.tp=2"]  # fmt: skip
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": pythonpath(REPO)},
    )
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith("nanolight: error:")]
    assert len(ours) == 1 and "world size 3 != tp*pp*dp = 2*1*1 = 2" in ours[0], proc.stderr[-3000:]
    assert "ValueError" not in proc.stderr


def _store_and_beat() -> tuple[Any, Heartbeat]:
    """A rendezvous store and rank 0's heartbeat in it (world of 2), as `init_distributed` makes."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        host, number = probe.getsockname()
    store = dist.TCPStore(host, number, is_master=True, timeout=timedelta(seconds=10))
    store.set(KEY.format(1), repr(time.time()))  # rank 1 beat just now: not silent
    return store, Heartbeat(host, number, rank=0, world_size=2)


def test_a_peers_own_error_is_the_first_thing_said() -> None:
    """A flipped byte in rank-00001.pt: rank 1 knows the damaged file, rank 0 only that its barrier
    failed when rank 1 exited. Rank 1 leaves its error in the store; rank 0 prints it first."""
    store, beat = _store_and_beat()
    try:
        beat.rank, beat.world_size = 1, 2  # speak as rank 1 for a moment
        publish_error("checkpoint file step-4/rank-00001.pt is damaged: its checksum differs")
        beat.rank = 0
        message = str(PeerError.of(RuntimeError("Connection closed by peer"), "a barrier", beat))
    finally:
        beat.close()
    assert message.startswith("rank 1: checkpoint file step-4/rank-00001.pt is damaged"), message
    assert "still alive" not in message and "\n" not in message


def test_a_killed_peer_is_named_dead_at_once() -> None:
    """SIGKILL leaves no error and a heartbeat only a second old: the dead process itself says it."""
    store, beat = _store_and_beat()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    store.set(PID_KEY.format(1), f"{socket.gethostname()} {dead.pid}")
    try:
        message = str(PeerError.of(RuntimeError("Connection closed by peer"), "the forward", beat))
    finally:
        beat.close()
    assert message.startswith(f"rank 1 (pid {dead.pid}) died"), message
    assert "still alive" not in message


def _flip(file: Path) -> None:
    data = file.read_bytes()
    pos = len(data) - 10
    file.write_bytes(data[:pos] + bytes([data[pos] ^ 1]) + data[pos + 1 :])


@pytest.mark.slow
def test_a_killed_rank_is_named_dead_and_a_damaged_rank_file_is_the_first_line_at_cp2(
    tmp_path: Path, cache_dir: Path
) -> None:
    """A cp2 run's rank 1 SIGKILLed once it has saved a checkpoint: the launcher names it dead. Then
    rank 1's file of that checkpoint damaged: resuming, the first line names the file."""
    run = tmp_path / "run"
    cp2 = ("+parallel.cp=2", "checkpoint.every_n_steps=2")
    proc = _recipe(run, cache_dir, "trainer.max_steps=100000", *cp2)
    try:
        pids = _training(proc, run, 2, ready=run / "checkpoints" / "last")
        os.kill(pids[1], signal.SIGKILL)
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "still alive" not in err and "Traceback" not in err, err
    assert f"rank 1 (pid {pids[1]}) was killed by SIGKILL" in err, err
    errors = [line for line in err.splitlines() if line.startswith("nanolight: error")]
    assert all(line.startswith(f"nanolight: error: rank 1 (pid {pids[1]}) died") for line in errors), err

    last = (run / "checkpoints" / "last").read_text().strip()  # a whole checkpoint, whenever the kill came
    _flip(run / "checkpoints" / last / "rank-00001.pt")
    proc = _recipe(
        run, cache_dir, f"trainer.max_steps={int(last.split('-')[1]) + 2}", "checkpoint.resume=last", *cp2
    )
    _, err = proc.communicate(timeout=240)
    errors = [line for line in err.splitlines() if line.startswith(("nanolight: error", "[nanolight"))]
    assert proc.returncode == 1 and errors, err
    assert errors[0].startswith("nanolight: error: rank 1: checkpoint file"), err
    assert "rank-00001.pt is damaged" in errors[0] and "Traceback" not in err


def _unwritable(rank: int, world: int, root: str) -> str:
    # Rank 0 cannot write into the run directory (read-only to a user; the tests run as root,
    # whom permissions do not stop, so rank 0's write fails as a read-only filesystem's would).
    if rank == 0:
        from nanolight.checkpoint import atomic

        real = atomic.atomic_write_text

        def read_only(path: Any, text: str) -> None:
            if Path(path).name.startswith(".nanolight-shared-"):
                raise PermissionError(13, "Permission denied", str(path))
            real(path, text)

        atomic.atomic_write_text = read_only
    return _one_step_or_error(world, str(Path(root) / "run"))


def test_an_unwritable_run_directory_is_one_line_on_every_rank(tmp_path: Path) -> None:
    """A read-only checkpoints/ once ended in tracebacks with c10d frames (rank 0 died writing the
    shared-directory probe while its peers waited in a barrier)."""
    errors = run_distributed(_unwritable, 2, str(tmp_path), timeout=120)
    for err in errors:
        assert "cannot write into" in err and "Permission denied" in err and "default_root_dir" in err, err
