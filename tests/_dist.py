"""Multi-process test harness: run a function on N gloo CPU ranks, collect results, never hang.

`run_distributed(fn, world_size, *args)` starts `world_size` fresh processes (from a
forkserver: no inherited torch threads or process groups), each initialises a gloo world on a free local
port with a short collective timeout and calls `fn(rank, world_size, *args)`. The parent
returns the per-rank return values, or raises with the first failing rank's traceback. A
wall-clock deadline kills every child, so a deadlocked collective fails the test instead of
hanging CI. `fn` must be a module-level function (it is pickled by name).

Every rank runs under the NCCL emulation (``_nccl_emulation``, installed in the forkserver before
torch.distributed's functions are bound anywhere): when every rank returns, the parent checks
their recordings by NCCL's rules and fails the test with what NCCL would hang on
(``check_nccl=False`` only for a test that breaks the rules on purpose).
"""

from __future__ import annotations

import os
import pickle
import queue
import re
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing import forkserver
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _nccl_emulation import assert_nccl_safe, install, installed, recording

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS)


def pythonpath(*first: object) -> str:
    """$PYTHONPATH for a process a test starts: `first`, then what is there already (which holds
    the NCCL emulation's ``_nccl_site``, `conftest.py`)."""
    return os.pathsep.join([*map(str, first), *filter(None, [os.environ.get("PYTHONPATH")])])


# what a process a test starts imports, by Python's own report (`-X importtime`: a line on stderr
# for each module, in the process and in every child it starts, which inherit the variable)
IMPORT_REPORT = {"PYTHONPROFILEIMPORTTIME": "1"}
# what a training process (the recipe's one process, the launcher, each rank) never imports under
# logger=csv on a local corpus: the dry run's tools (torch's trackers), hub datasets, wandb
NOT_IMPORTED_BY_A_RUN = ("torch.distributed._tools", "datasets", "wandb")
_REPORT_LINE = re.compile(r"^import time:\s+\d+ \|\s+\d+ \| *(\S+)$", re.MULTILINE)


def imported(stderr: str, *packages: str) -> list[str]:
    """The modules of `packages` (each a module or a package with all of its submodules) that
    `stderr`'s import report names."""
    return sorted(
        m for m in set(_REPORT_LINE.findall(stderr)) if any(m == p or m.startswith(p + ".") for p in packages)
    )


def without_import_report(stderr: str) -> str:
    """`stderr` as the process wrote it, less the report's lines."""
    return "\n".join(ln for ln in stderr.splitlines() if not ln.startswith("import time:"))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context() -> Any:
    """A forkserver that imported torch, nanolight's trainer and torch._dynamo once per test
    session: each rank then starts in milliseconds instead of importing them again (seconds per
    rank: torch._dynamo, which any torch optimizer's constructor imports, costs as much as torch),
    and still inherits no threads or process groups from the pytest process (plain fork would)."""
    ctx = mp.get_context("forkserver")
    # the emulation first: nanolight binds some torch.distributed functions to names at import
    preload = ["_nccl_preinstall", "torch", "torch.distributed", "torch._dynamo", "nanolight.parallel"]
    ctx.set_forkserver_preload([*preload, "nanolight.trainer", "pytest"])  # what every test module imports
    # the forkserver imports them before it has our sys.path: give it tests/ on $PYTHONPATH (it
    # takes it off again, `_nccl_preinstall`)
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([TESTS, *([before] if before else [])])
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
    return ctx


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple,
    results: Any,
    pg_timeout: float,
) -> None:
    torch.set_num_threads(1)  # N ranks share a few CPU cores; oversubscription only slows us down
    # what torchrun would set, so code that asks the launcher finds a running world
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        if not installed():
            raise RuntimeError(
                "the forkserver did not preload _nccl_preinstall (tests/ not on its sys.path?)"
            )
        install()
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout),
        )
        out = fn(rank, world_size, *args)
        # plain pickle bytes: a tensor put on the queue as it is would travel as a handle to this
        # process's shared memory, which is gone if the process exits before the parent reads it
        results.put((rank, "ok", pickle.dumps((out, recording()))))
    except BaseException:  # noqa: BLE001 - report everything to the parent, incl. assertion errors
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 90.0,
    pg_timeout: float = 30.0,
    check_nccl: bool = True,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return results by rank, once
    their recorded traffic is found NCCL-safe (`check_nccl`)."""
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, args, results, pg_timeout), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    outputs: dict[int, Any] = {}
    try:
        while len(outputs) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"distributed test did not finish in {timeout:.0f}s; ranks done: {sorted(outputs)}"
                )
            try:
                rank, status, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outputs]
                if dead:
                    raise RuntimeError(
                        f"rank(s) {dead} died without reporting (exit codes "
                        f"{[procs[r].exitcode for r in dead]})"
                    ) from None
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            outputs[rank] = pickle.loads(payload)
    except BaseException:
        for p in procs:  # peers of a failed rank may be blocked in a collective: do not wait
            p.kill()
        raise
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if check_nccl:
        assert_nccl_safe([outputs[r][1] for r in range(world_size)])
    return [outputs[r][0] for r in range(world_size)]
