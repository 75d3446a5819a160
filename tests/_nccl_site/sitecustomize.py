"""Puts every Python process a test starts under the NCCL emulation (``tests/_nccl_emulation.py``).

``tests/conftest.py`` puts this directory on $PYTHONPATH and sets $NANOLIGHT_NCCL_RECORD for each
test; without that variable this does nothing. The emulation installs itself as soon as the
process has imported ``torch.distributed`` (before nanolight can bind its functions), so a process
that never uses it -- a small ``python -c`` a test runs -- imports nothing more than it would.
It is loaded by its file's path (tests/ itself stays off sys.path) under its module name, so that
the recordings it writes unpickle in the test's process.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys


def _install() -> None:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("_nccl_emulation", os.path.join(here, "_nccl_emulation.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["_nccl_emulation"] = module
    spec.loader.exec_module(module)
    module.install_from_env()


class _ThenInstall(importlib.abc.Loader):
    """torch.distributed's own loader, then the emulation."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec):  # noqa: ANN001, ANN201 - the loader protocol
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:  # noqa: ANN001
        self.loader.exec_module(module)
        _install()


class _WatchTorchDistributed(importlib.abc.MetaPathFinder):
    """Finds torch.distributed as the path finder does, with `_ThenInstall` as its loader."""

    def find_spec(self, name, path=None, target=None):  # noqa: ANN001, ANN201 - the finder protocol
        if name != "torch.distributed":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenInstall(spec.loader)
        return spec


if os.environ.get("NANOLIGHT_NCCL_RECORD"):
    sys.meta_path.insert(0, _WatchTorchDistributed())
