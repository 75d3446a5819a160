"""Calling hooks as Lightning does: callbacks (in order) before the module, only what is
overridden; the datamodule's data hooks before the module's; ``on_load_checkpoint`` module first;
monitoring callbacks (ModelCheckpoint, EarlyStopping) after the module at a train epoch's end.

Also the callback list itself: the trainer's, plus those the module's ``configure_callbacks``
returns (they replace trainer callbacks of the same type), checkpointing callbacks last.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_utilities.core.overrides import is_overridden

from nanolight.callbacks.base import Callback
from nanolight.callbacks.early_stopping import EarlyStopping
from nanolight.callbacks.model_checkpoint import ModelCheckpoint
from nanolight.module import NanoDataModule
from nanolight.module.module import NanoModule
from nanolight.utilities.signature_utils import is_param_in_hook_signature

if TYPE_CHECKING:
    from nanolight.trainer.trainer import NanoTrainer

CALLBACK_ONLY = frozenset(
    {"on_sanity_check_start", "on_sanity_check_end", "on_exception"}
)  # the module has no hook of these names
BATCH_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")


def _defines(obj: Any, name: str, base: type) -> bool:
    """`obj` has its own `name`: its class overrides `base`'s, or the hook was attached to the
    instance (Lightning calls hooks whatever their origin; its hook-order tests attach them so)."""
    return name in getattr(obj, "__dict__", {}) or is_overridden(name, obj, base)


def order_callbacks(callbacks: list[Callback]) -> list[Callback]:
    """Checkpointing last, so a save holds what every other callback did this step (Lightning)."""
    return [c for c in callbacks if not isinstance(c, ModelCheckpoint)] + [
        c for c in callbacks if isinstance(c, ModelCheckpoint)
    ]


def merge_model_callbacks(trainer_callbacks: list[Callback], model_callbacks: Any) -> list[Callback]:
    """``configure_callbacks``' callbacks replace the trainer's callbacks of the same types."""
    extra = [model_callbacks] if isinstance(model_callbacks, Callback) else list(model_callbacks or [])
    if not extra:
        return trainer_callbacks
    replaced = {type(c) for c in extra}
    kept = [c for c in trainer_callbacks if type(c) not in replaced]
    return order_callbacks(kept + extra)


class HookCaller:
    """Mixed into `NanoTrainer`: every hook call goes through these methods."""

    def call_hook(self: NanoTrainer, name: str, *args: Any, returns: bool = False) -> Any:
        """Callbacks then the module (resolved once per trainer call: a step fires many hooks)."""
        targets = self._hook_targets.get(name)
        if targets is None:
            targets = self._resolve(name)
        result = None
        previous, self.metrics.hook = self.metrics.hook, name
        try:
            for fn, is_callback in targets:
                out = fn(self, self.lightning_module, *args) if is_callback else fn(*args)
                if not is_callback:
                    result = out
        finally:
            self.metrics.hook = previous
        return result if returns else None

    def _resolve(self: NanoTrainer, name: str) -> list[tuple[Any, bool]]:
        module = self.lightning_module
        monitoring = (ModelCheckpoint, EarlyStopping)
        cbs = [cb for cb in self.callbacks if _defines(cb, name, Callback)]
        targets = [(getattr(cb, name), True) for cb in cbs]
        if name not in CALLBACK_ONLY and _defines(module, name, NanoModule):
            targets.append((getattr(module, name), False))
        if name == "on_train_epoch_end":  # monitoring callbacks see what the module logged there
            targets = [t for t, cb in zip(targets, cbs + [None], strict=False) if not isinstance(cb, monitoring)]
            targets += [(getattr(cb, name), True) for cb in cbs if isinstance(cb, monitoring)]
        self._hook_targets[name] = targets
        return targets

    def call_module_hook(self: NanoTrainer, name: str, *args: Any) -> Any:
        """The module's hook (overridden or its default), e.g. training_step, optimizer_step."""
        previous, self.metrics.hook = self.metrics.hook, name
        try:
            return getattr(self.lightning_module, name)(*args)
        finally:
            self.metrics.hook = previous

    def call_step(self: NanoTrainer, name: str, batch: Any, batch_idx: int, *extra: Any) -> Any:
        """``training_step`` / ``validation_step`` / ...: ``batch_idx`` is passed only when the
        signature takes it, as Lightning does (``def training_step(self, batch)`` is valid)."""
        fn = getattr(self.lightning_module, name)
        takes_idx = is_param_in_hook_signature(fn, "batch_idx", min_args=2)
        return self.call_module_hook(name, batch, *((batch_idx,) if takes_idx else ()), *extra)

    def call_datamodule_hook(self: NanoTrainer, name: str, *args: Any) -> Any:
        dm = self.datamodule
        if dm is None or not _defines(dm, name, NanoDataModule):
            return None
        previous, self.metrics.hook = self.metrics.hook, name
        try:
            return getattr(dm, name)(*args)
        finally:
            self.metrics.hook = previous

    def call_setup_hook(self: NanoTrainer, name: str, stage: str) -> None:
        """``setup`` / ``teardown``: the datamodule, then callbacks, then the module (Lightning)."""
        self.call_datamodule_hook(name, stage)
        self.call_hook(name, stage)

    def transfer_batch(self: NanoTrainer, batch: Any, dataloader_idx: int = 0) -> Any:
        """Precision cast, then the batch-transfer hooks (a datamodule's override wins)."""
        batch = self.strategy.precision.convert_input(batch)
        device = self.strategy.root_device
        for name in BATCH_HOOKS:
            args = (batch, device, dataloader_idx) if name == "transfer_batch_to_device" else (batch, dataloader_idx)
            dm = self.datamodule
            if dm is not None and _defines(dm, name, NanoDataModule):
                batch = self.call_datamodule_hook(name, *args)
            else:
                batch = self.call_module_hook(name, *args)
        return batch
