"""Helpers for tests/test_checkpoint_recipe.py: launch `recipes/smollm.py` as a process tree we can
SIGKILL from outside, and a wrapper script that makes every rank SIGKILL itself midway through
writing one chosen checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from _dist import pythonpath
from test_recipe_e2e import BASE_OVERRIDES, REPO
from test_recipe_parallel import _children

RECIPE = REPO / "recipes" / "smollm.py"


def command(script: Path, run_dir: Path, cache: Path, *overrides: str) -> list[str]:
    return [
        sys.executable,
        str(script),
        f"trainer.default_root_dir={run_dir}",
        f"data.cache_dir={cache}",
        *BASE_OVERRIDES,
        *overrides,
    ]


def env() -> dict[str, str]:
    # this checkout's code, whatever an editable install elsewhere points at
    return {**os.environ, "WANDB_SILENT": "true", "PYTHONPATH": pythonpath(REPO)}


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (the launcher's ranks, and anything they started)."""
    out, todo = [], [pid]
    while todo:
        kids = _children(todo.pop())
        out += kids
        todo += kids
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie has already died; only its parent's wait is missing


def sigkill_tree(parent: subprocess.Popen, timeout: float = 30) -> list[int]:
    """SIGKILL the launcher and all its ranks at once (a node dying), wait until all are gone."""
    victims = [parent.pid, *descendants(parent.pid)]
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    parent.wait(timeout=timeout)
    deadline = time.monotonic() + timeout
    while any(_alive(pid) for pid in victims[1:]):
        assert time.monotonic() < deadline, "ranks survived SIGKILL"
        time.sleep(0.05)
    return victims


def tail(path: Path, n: int = 4000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


def read_last(ckpt_dir: Path) -> str | None:
    try:
        return (ckpt_dir / "last").read_text().strip()
    except OSError:
        return None


# The wrapper is the script every rank runs: the launcher re-launches sys.argv[0] (see
# nanolight/parallel/launcher.py `_script_command`), so it execs the recipe's source in place
# rather than through runpy (which would point sys.argv[0] at the recipe). Hydra finds conf/
# through the compiled code's file name, which stays recipes/smollm.py.
KILL_WRAPPER = '''\
"""recipes/smollm.py, but rank {kill_rank} SIGKILLs itself at its first write into checkpoint step-{step}."""
import os
import re
import signal
import sys

import safetensors.torch
import torch

RECIPE = {recipe!r}
MARKER = {marker!r}
CKPT_DIR = os.path.realpath({ckpt_dir!r})
TARGET = re.compile(r"step-{step}(?!\\d)")  # step-4, .tmp-step-4-123, step-4.tmp, step-4/x ...
ARMED = os.environ.get("RANK") == "{kill_rank}"  # the launcher (no RANK) and the other ranks live on


def _hit(*paths):
    if not ARMED:
        return None
    for p in paths:
        if hasattr(p, "fileno") and not isinstance(p, int):
            p = getattr(p, "name", "")
        try:
            s = os.fsdecode(p)
        except TypeError:
            continue
        s = os.path.realpath(s)
        if s.startswith(CKPT_DIR + os.sep) and TARGET.search(s[len(CKPT_DIR) :]):
            return s
    return None


def _die(where, path):
    with open(MARKER, "a") as f:
        f.write(f"{{os.getpid()}} {{where}} {{path}}\\n")
    os.kill(os.getpid(), signal.SIGKILL)


def _after_write(name, real):
    def wrapped(obj, f, *args, **kwargs):
        out = real(obj, f, *args, **kwargs)
        path = _hit(f)
        if path:
            _die(name, path)  # the file is written, the checkpoint is not finished
        return out

    return wrapped


def _before(name, real):
    def wrapped(*args, **kwargs):
        path = _hit(*args[:2])
        if path:
            _die(name, path)
        return real(*args, **kwargs)

    return wrapped


_real_fsync = os.fsync


def fsync(fd):
    fd = fd if isinstance(fd, int) else fd.fileno()
    try:
        path = _hit(os.readlink(f"/proc/self/fd/{{fd}}"))
    except OSError:
        path = None
    if path:
        _die("os.fsync", path)
    return _real_fsync(fd)


# patched before nanolight is imported: `from safetensors.torch import save_file` binds these
safetensors.torch.save_file = _after_write("safetensors.torch.save_file", safetensors.torch.save_file)
torch.save = _after_write("torch.save", torch.save)
os.fsync = fsync
os.replace = _before("os.replace", os.replace)
os.rename = _before("os.rename", os.rename)

code = compile(open(RECIPE).read(), RECIPE, "exec")
exec(code, {{"__name__": "__main__", "__file__": RECIPE, "__builtins__": __builtins__}})
'''


def write_kill_wrapper(path: Path, ckpt_dir: Path, step: int, kill_rank: int, marker: Path) -> Path:
    """A script that runs the recipe, where global rank `kill_rank` SIGKILLs itself right after its
    first file write into checkpoint `step` (or at its first fsync/rename there, whichever comes
    first) and appends "<pid> <function> <path>" to `marker` just before."""
    path.write_text(
        KILL_WRAPPER.format(
            recipe=str(RECIPE), marker=str(marker), ckpt_dir=str(ckpt_dir), step=step, kill_rank=kill_rank
        )
    )
    return path
