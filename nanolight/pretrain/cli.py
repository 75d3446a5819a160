"""Entry points report nanolight's errors as one line, once: ``nanolight: error: ...``.

Every error nanolight raises on purpose (`nanolight.errors.NanolightError`: a config, a layout, a
checkpoint, the data, a full disk, a silent peer) already says what is wrong and how to fix it, so
a traceback through Hydra and torch only buries it. Under torchrun every rank raises the same
error: rank 0 prints it (and a rank whose error is its own, e.g. its disk is full). Anything else
is a bug and keeps its traceback. ``--debug`` (or ``HYDRA_FULL_ERROR=1``) shows the traceback of
nanolight's errors too.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from nanolight.errors import NanolightError
from nanolight.parallel.environment import detect_environment
from nanolight.pretrain.schema import ConfigError

DEBUG_FLAG = "--debug"


def take_debug_flag(argv: list[str]) -> bool:
    """Remove ``--debug`` from `argv` (Hydra would reject it); children inherit HYDRA_FULL_ERROR."""
    if DEBUG_FLAG in argv:
        argv.remove(DEBUG_FLAG)
        os.environ["HYDRA_FULL_ERROR"] = "1"
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def _rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    env = detect_environment()
    return env.rank if env is not None else 0


@contextmanager
def reported_errors(debug: bool = False) -> Iterator[None]:
    """Run the body; a `NanolightError` becomes one line on stderr and exit status 2 (a config
    error) or 1. With `debug` the traceback is printed as usual."""
    try:
        yield
    except NanolightError as err:
        if debug:
            raise
        if _rank() == 0 or err.rank_specific:
            print(f"nanolight: error: {err}", file=sys.stderr, flush=True)
        sys.exit(2 if isinstance(err, ConfigError) else 1)
