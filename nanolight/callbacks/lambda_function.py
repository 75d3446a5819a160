"""`LambdaCallback`: a callback made on the spot from functions, one keyword argument per hook
(Lightning's), so a script can watch a hook without writing a class."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nanolight.callbacks.base import Callback

# The hooks a callback may have (state_dict/load_state_dict are not hooks: Lightning's take none).
HOOKS = frozenset(
    name
    for name, value in vars(Callback).items()
    if callable(value) and (name.startswith("on_") or name in ("setup", "teardown"))
)


class LambdaCallback(Callback):
    """``LambdaCallback(on_train_batch_end=fn, ...)``: each function is called with the hook's
    arguments (``trainer, pl_module, ...``); hooks not given do nothing."""

    def __init__(self, **hooks: Callable[..., Any] | None) -> None:
        unknown = sorted(set(hooks) - HOOKS)
        if unknown:
            raise TypeError(
                f"LambdaCallback got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
                f"it takes the Callback hooks: {', '.join(sorted(HOOKS))}"
            )
        for name, fn in hooks.items():
            if fn is not None:
                setattr(self, name, fn)
