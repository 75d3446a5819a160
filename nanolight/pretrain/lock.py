"""One run per run directory: an OS file lock (``flock``) on the run directory itself.

Why: two runs started in one directory would both train, interleave their `metrics.csv` rows and
write over each other's checkpoints. Why an OS lock and not a marker file: the kernel drops it
when its process ends, however it ends (SIGKILL, a crash), so a killed run never leaves the
directory locked; a marker would need someone to decide it is stale. The directory itself is
locked, so a run that is refused (or fails its config check) leaves nothing behind; where a
filesystem cannot lock a directory (NFS emulates ``flock`` with write locks), ``.nanolight.lock``
inside it is locked instead.

Who holds it: the process that owns the run, for its whole life -- the one process, or under plain
python the launcher parent (which outlives its ranks and exits with their status); under
torchrun/srun global rank 0 (no other process of the job is on every node). The ranks our
launcher starts do not take it: their parent holds it for them.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from nanolight.errors import UsageError
from nanolight.parallel.environment import detect_environment

LOCK_NAME = ".nanolight.lock"


class RunDirectoryInUse(UsageError):
    """Another live run holds the run directory."""


def owns_run() -> bool:
    """Whether this process holds the run's lock (see the module docstring)."""
    env = detect_environment()
    return env is None or (env.source != "subprocess" and env.rank == 0)


@contextmanager
def run_lock(root: Path) -> Iterator[None]:
    """Hold `root`'s lock for the body (this process's run), or fail at once naming the holder.
    A no-op on the processes that do not own the run."""
    if not owns_run():
        yield
        return
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root, os.O_RDONLY)
    try:
        try:
            _lock(fd, root)
        except OSError:  # this filesystem cannot lock a directory: lock a file in it
            os.close(fd)
            fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
            _lock(fd, root)
        yield
    finally:
        os.close(fd)  # releases the lock (the kernel does the same when the process dies)


def _lock(fd: int, root: Path) -> None:
    """Lock `fd` (the run directory or its lock file) or say who holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RunDirectoryInUse(
            f"run directory {root} is in use by another run ({_holder(fd)}); wait for it to end or "
            "stop it, or start this run with trainer.default_root_dir=<another dir>"
        ) from None


def _holder(fd: int) -> str:
    """The process holding the lock on `fd`'s inode, from /proc/locks where there is one."""
    st = os.fstat(fd)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        for line in Path("/proc/locks").read_text().splitlines():
            fields = line.split()
            if "FLOCK" in fields and inode in fields:
                pid = fields[fields.index("FLOCK") + 3]
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                return f"pid {pid}: {cmd.strip()[:120]}"
    except (OSError, ValueError, IndexError):
        pass
    return "another process"
