"""Puts every Python process a test starts under the NCCL emulation (``tests/_nccl_emulation.py``).

``tests/conftest.py`` puts this directory on $PYTHONPATH and sets $NANOLIGHT_NCCL_RECORD for each
test; without that variable this does nothing. The emulation installs itself just before the
process first imports nanolight (which binds torch.distributed's functions at import), so a
process that never does -- a small ``python -c`` a test runs -- does not pay for importing torch.
It is loaded by its file's path (tests/ itself stays off sys.path) under its module name, so that
the recordings it writes unpickle in the test's process.
"""

import importlib.abc
import importlib.util
import os
import sys


class _InstallBeforeNanolight(importlib.abc.MetaPathFinder):
    """Finds nothing itself: on the first import of nanolight it installs the emulation, then
    steps aside for the usual finders."""

    def find_spec(self, name, path=None, target=None):  # noqa: ANN001, ANN201 - the finder protocol
        if name != "nanolight":
            return None
        sys.meta_path.remove(self)
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        spec = importlib.util.spec_from_file_location(
            "_nccl_emulation", os.path.join(here, "_nccl_emulation.py")
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["_nccl_emulation"] = module
        spec.loader.exec_module(module)
        module.install_from_env()
        return None


if os.environ.get("NANOLIGHT_NCCL_RECORD"):
    sys.meta_path.insert(0, _InstallBeforeNanolight())
