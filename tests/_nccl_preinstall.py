"""Imported first by `_dist`'s forkserver: every rank it forks records from its first line.

`_dist` put tests/ first on $PYTHONPATH for the forkserver to find this module; it is taken off
again, so that the processes the ranks start do not inherit it."""

import os

from _nccl_emulation import install

install()
_first, *_rest = os.environ.get("PYTHONPATH", "").split(os.pathsep)
if _first == os.path.dirname(os.path.abspath(__file__)):
    if _rest:
        os.environ["PYTHONPATH"] = os.pathsep.join(_rest)
    else:
        del os.environ["PYTHONPATH"]
