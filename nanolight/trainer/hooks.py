"""Calling hooks as Lightning does (the trainer's ``hooks`` part): callbacks (in order) before the
module, only what is overridden; the datamodule's data hooks before the module's;
``on_load_checkpoint`` module first; monitoring callbacks (ModelCheckpoint, EarlyStopping) after
the module at a train epoch's end. Every call records the running hook, which sets
``self.log``'s defaults.

Also the callback list itself: the trainer's, plus those the module's ``configure_callbacks``
returns (they replace trainer callbacks of the same type), checkpointing callbacks last.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
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

# the module has no hook of these names
CALLBACK_ONLY = frozenset({"on_sanity_check_start", "on_sanity_check_end", "on_exception"})
# callbacks that watch a metric: at a train epoch's end they run after the module (Lightning)
MONITORING = (ModelCheckpoint, EarlyStopping)
BATCH_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")


def defines(obj: Any, name: str, base: type) -> bool:
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
    """Every hook call of a trainer goes through this object."""

    def __init__(self, trainer: NanoTrainer) -> None:
        self.trainer = trainer
        self._targets: dict[str, list[tuple[Callable[..., Any], bool]]] = {}

    def reset(self) -> None:
        """A new trainer call: the module and callbacks may have changed."""
        self._targets = {}

    @contextmanager
    def _running(self, name: str) -> Iterator[None]:
        metrics = self.trainer.metrics
        previous, metrics.hook = metrics.hook, name
        try:
            yield
        finally:
            metrics.hook = previous

    def call(
        self, name: str, *args: Any, returns: bool = False, monitoring: bool | None = None, **kwargs: Any
    ) -> Any:
        """Callbacks then the module (resolved once per trainer call: a step fires many hooks).
        `monitoring`: True runs only the monitoring callbacks (ModelCheckpoint, EarlyStopping),
        False everything else, None all (Lightning's ``monitoring_callbacks``)."""
        trainer = self.trainer
        targets = self._targets.get(name)
        if targets is None:
            targets = self._targets[name] = self._resolve(name)
        result = None
        with self._running(name):
            for fn, is_callback, monitors in targets:
                if monitoring is not None and monitors != monitoring:
                    continue
                out = (
                    fn(trainer, trainer.lightning_module, *args, **kwargs)
                    if is_callback
                    else fn(*args, **kwargs)
                )
                if not is_callback:
                    result = out
        return result if returns else None

    def _resolve(self, name: str) -> list[tuple[Callable[..., Any], bool, bool]]:
        """(hook, is a callback's, is a monitoring callback's) in calling order."""
        module = self.trainer.lightning_module
        cbs = [cb for cb in self.trainer.callbacks if defines(cb, name, Callback)]
        targets = [(getattr(cb, name), True, isinstance(cb, MONITORING)) for cb in cbs]
        if name not in CALLBACK_ONLY and defines(module, name, NanoModule):
            targets.append((getattr(module, name), False, False))
        if name == "on_train_epoch_end":  # monitoring callbacks see what the module logged there
            targets = [t for t in targets if not t[2]] + [t for t in targets if t[2]]
        return targets

    def module(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """The module's hook (overridden or its default), e.g. training_step, optimizer_step."""
        with self._running(name):
            return getattr(self.trainer.lightning_module, name)(*args, **kwargs)

    def step(self, name: str, batch: Any, batch_idx: int, *extra: Any) -> Any:
        """``training_step`` / ``validation_step`` / ...: ``batch_idx`` is passed only when the
        signature takes it, as Lightning does (``def training_step(self, batch)`` is valid)."""
        fn = getattr(self.trainer.lightning_module, name)
        takes_idx = is_param_in_hook_signature(fn, "batch_idx", min_args=2)
        return self.module(name, batch, *((batch_idx,) if takes_idx else ()), *extra)

    def datamodule(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """The datamodule's hook, when it defines one."""
        dm = self.trainer.datamodule
        if dm is None or not defines(dm, name, NanoDataModule):
            return None
        with self._running(name):
            return getattr(dm, name)(*args, **kwargs)

    def setup(self, name: str, stage: str) -> None:
        """``setup`` / ``teardown``: the datamodule, then callbacks, then the module (Lightning),
        `stage` passed by keyword as Lightning does (``LambdaCallback(setup=lambda *a, **kw: ...)``)."""
        self.datamodule(name, stage=stage)
        self.call(name, stage=stage)

    def transfer_batch(self, batch: Any, dataloader_idx: int = 0) -> Any:
        """Precision cast, the batch-transfer hooks (a datamodule's override wins: its class's, or
        a function attached to it, but not a wrapper of its default -- Lightning's ``is_overridden``),
        then this rank's share of the sequences (context parallelism: `Strategy.shard_batch`)."""
        strategy, dm = self.trainer.strategy, self.trainer.datamodule
        batch = strategy.precision.convert_input(batch)
        for name in BATCH_HOOKS:
            device = (strategy.root_device,) if name == "transfer_batch_to_device" else ()
            if dm is not None and is_overridden(name, dm, NanoDataModule):
                with self._running(name):
                    batch = getattr(dm, name)(batch, *device, dataloader_idx)
            else:
                batch = self.module(name, batch, *device, dataloader_idx)
        return strategy.shard_batch(batch)
