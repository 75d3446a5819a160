"""``lightning.pytorch.core`` ported: the module's home under Lightning's package name, so
``from nanolight.core import NanoModule`` (and ``nanolight.core.module`` / ``.datamodule`` /
``.hooks``) resolve to the classes in `nanolight.module`, not to copies of them."""

import sys

from nanolight.module import hooks, module
from nanolight.module.module import NanoDataModule, NanoModule

# Lightning's submodule names, as aliases of nanolight's own modules (one class, two import paths)
for _name, _mod in {"module": module, "datamodule": module, "hooks": hooks}.items():
    sys.modules[f"{__name__}.{_name}"] = _mod

__all__ = ["NanoDataModule", "NanoModule"]
