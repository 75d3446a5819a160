"""Puts every Python process a test starts under the NCCL emulation (``tests/_nccl_emulation.py``).

``tests/conftest.py`` puts this directory on $PYTHONPATH and sets $NANOLIGHT_NCCL_RECORD for each
test; without that variable this does nothing. The emulation is loaded by its file's path (tests/
itself stays off sys.path) under its module name, so that the recordings it writes unpickle in
the test's process.
"""

import importlib.util
import os
import sys

if os.environ.get("NANOLIGHT_NCCL_RECORD"):
    _path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_nccl_emulation.py")
    _spec = importlib.util.spec_from_file_location("_nccl_emulation", _path)
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["_nccl_emulation"] = _module
    _spec.loader.exec_module(_module)
    _module.install_from_env()
