"""``is_overridden`` as Lightning's ``utilities.model_helpers`` offers it: the parent class is
inferred from the instance (a module, a datamodule or a callback) when not given."""

from __future__ import annotations

from typing import Any

from lightning_utilities.core.overrides import is_overridden as _overrides


def is_overridden(method_name: str, instance: Any = None, parent: type | None = None) -> bool:
    """Whether `instance`'s class (or a wrapper of it) replaces `parent`'s `method_name`."""
    if instance is None:
        return False
    if parent is None:
        from nanolight.callbacks.base import Callback
        from nanolight.module import NanoDataModule, NanoModule

        parent = next(
            (cls for cls in (NanoModule, NanoDataModule, Callback) if isinstance(instance, cls)), None
        )
        if parent is None:
            raise ValueError(
                f"is_overridden: cannot infer the parent class of a {type(instance).__name__}; "
                "pass parent=NanoModule, NanoDataModule or Callback"
            )
    return _overrides(method_name, instance, parent)
