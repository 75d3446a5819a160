"""Which arguments a user's hook takes: Lightning passes ``batch_idx`` to ``training_step`` (and
the evaluation steps) only when the signature has room for it, so ``training_step(self, batch)``
is a valid program."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any


def is_param_in_hook_signature(
    hook_fx: Callable[..., Any], param: str, explicit: bool = False, min_args: int | None = None
) -> bool:
    """`param` is named in `hook_fx`'s signature, or (unless `explicit`) `*args` would take it, or
    it has at least `min_args` positional parameters besides the first (``self`` of a method)."""
    spec = inspect.getfullargspec(hook_fx)
    positional = spec.args[1:]
    return (
        param in positional
        or (not explicit and spec.varargs is not None)
        or (min_args is not None and len(positional) >= min_args)
    )
