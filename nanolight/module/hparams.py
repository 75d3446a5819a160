"""``save_hyperparameters()`` / ``self.hparams``: a module's (or datamodule's) constructor
arguments, kept so a checkpoint can rebuild the object (`load_from_checkpoint`) and a logger can
record them (``hparams.yaml``), as in Lightning.

Only plain values (numbers, strings, bools, None, and lists/tuples/dicts of them) go into a
checkpoint: it is read back with ``torch.load(weights_only=True)``, which refuses arbitrary
objects. Anything else (an ``nn.Module``, a config object) stays in ``self.hparams`` for this run
and is left out of checkpoints with a warning; `load_from_checkpoint` then takes it as a keyword.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle
import types
from collections.abc import Mapping
from typing import Any

from lightning_utilities.core.rank_zero import rank_zero_warn
from torch import nn

from nanolight.errors import UsageError


class AttributeDict(dict):
    """A dict whose keys also read as attributes: ``self.hparams.lr``."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError as exc:
            raise AttributeError(f"hparams has no {key!r}; it holds {sorted(self)}") from exc

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value

    def __delattr__(self, key: str) -> None:
        del self[key]


def _is_plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    return False


def plain_hparams(hparams: Mapping[str, Any], owner: str) -> dict[str, Any]:
    """The checkpointable part of `hparams` (see the module docstring); warns about the rest."""
    left_out = sorted(k for k, v in hparams.items() if not _is_plain(v))
    if left_out:
        rank_zero_warn(
            f"{owner}.hparams {left_out} are not plain values (numbers, strings, lists, dicts), so "
            f"checkpoints do not store them: pass them to load_from_checkpoint(..., {left_out[0]}=...) "
            f"or leave them out with save_hyperparameters(ignore={left_out!r})"
        )
    return {k: _to_builtin(v) for k, v in hparams.items() if k not in left_out}


def _to_builtin(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _to_builtin(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_to_builtin(v) for v in value]
    return copy.deepcopy(value)


def _frame_init_args(frame: types.FrameType) -> tuple[Any, dict[str, Any]] | None:
    """The instance and named arguments (current values, ``**kwargs`` merged in, ``self`` and
    ``*args`` left out) of a frame that runs a class's ``__init__`` written with ``super()`` (the
    ``__class__`` cell Lightning's collection keys on); None for any other frame."""
    code = frame.f_code
    if code.co_name != "__init__" or "__class__" not in frame.f_locals or not code.co_argcount:
        return None
    info = inspect.getargvalues(frame)
    names = code.co_varnames[1 : code.co_argcount + code.co_kwonlyargcount]
    args = {name: info.locals[name] for name in names if name in info.locals}
    if info.keywords:
        args.update(info.locals.get(info.keywords) or {})
    return info.locals.get(code.co_varnames[0]), args


def _collect_init_args(frame: types.FrameType | None) -> dict[str, Any]:
    """Lightning's collection: the arguments of every ``__init__`` on the way up from `frame` whose
    instance has hparams, from the innermost (the base class's) to the outermost, later ones winning
    (a subclass's arguments are collected even when only its base class saves); frames before the
    first such ``__init__`` (a decorator's wrapper) are skipped, the first other frame after it ends
    the walk (a plain object composing a module is not collected)."""
    collected: list[dict[str, Any]] = []
    while frame is not None and frame.f_back is not None:
        found = _frame_init_args(frame)
        if found is not None and isinstance(found[0], HyperparametersMixin):
            collected.append(found[1])
        elif collected:
            break
        frame = frame.f_back
    return {k: v for args in collected for k, v in args.items()}


def _as_mapping(given: Any) -> dict[str, Any]:
    """A dict / namespace given to ``save_hyperparameters``, as a dict."""
    if isinstance(given, Mapping):
        return dict(given)
    if isinstance(given, (bool, int, float, str)) or not hasattr(given, "__dict__"):
        raise UsageError(
            f"save_hyperparameters({given!r}): give argument names as strings, a dict or a namespace; "
            f"primitives and {type(given).__name__} are not hyperparameter containers"
        )
    return dict(vars(given))


def drop_unpicklable(hparams: dict[str, Any], owner: str) -> None:
    """Remove (with a warning) the hparams that cannot be pickled, as Lightning does when a trainer
    call starts: a checkpoint or a spawned process could not carry them."""
    for key in [k for k, v in hparams.items() if not _picklable(v)]:
        rank_zero_warn(
            f"Attribute {key!r} removed from {owner}.hparams because it cannot be pickled; leave it out "
            f"with save_hyperparameters(ignore=[{key!r}])"
        )
        del hparams[key]


def _picklable(value: Any) -> bool:
    try:
        pickle.dumps(value)
    except (pickle.PickleError, AttributeError, RuntimeError, TypeError):
        return False
    return True


class HyperparametersMixin:
    """``save_hyperparameters`` and ``hparams`` for `NanoModule` and `NanoDataModule`."""

    def save_hyperparameters(
        self,
        *args: Any,
        ignore: str | list[str] | None = None,
        frame: types.FrameType | None = None,
        logger: bool = True,
    ) -> None:
        """Record constructor arguments in ``self.hparams``: all of them (no `args`), the named
        ones (strings), or a dict / namespace. `ignore` drops names; ``logger=False`` keeps them
        out of the loggers' hparams."""
        if len(args) == 1 and not isinstance(args[0], str) and not args[0]:
            return  # an empty container: nothing to save (Lightning)
        caller = frame or inspect.currentframe().f_back  # type: ignore[union-attr]
        init = self._init_args(caller)
        if args and len(args) == 1 and not isinstance(args[0], str):
            given = args[0]
            values = _as_mapping(given)
            # the __init__ argument it came in as: load_from_checkpoint passes it back under that name
            hparams_name = next((k for k, v in init.items() if v is given), None)
        else:
            missing = [a for a in args if a not in init]
            if missing:
                raise UsageError(
                    f"save_hyperparameters({', '.join(map(repr, args))}): {missing} are not arguments of "
                    f"{type(self).__name__}.__init__ (its arguments: {sorted(init)})"
                )
            values = {a: init[a] for a in args} if args else init
            hparams_name = "kwargs" if values else None
        drop = {ignore} if isinstance(ignore, str) else set(ignore or ())
        for name, value in values.items():
            if isinstance(value, nn.Module) and name not in drop:
                rank_zero_warn(
                    f"hparam {name!r} is an nn.Module: its weights are saved with the model already; "
                    f"leave it out with save_hyperparameters(ignore=[{name!r}])"
                )
        values = {k: v for k, v in values.items() if k not in drop}
        self.hparams.update(values)
        for name in drop:  # a subclass may drop what its base class saved
            self.hparams.pop(name, None)
        object.__setattr__(self, "_hparams_initial", copy.copy(self.hparams))
        object.__setattr__(self, "_log_hyperparams", logger)
        object.__setattr__(self, "_hparams_name", hparams_name)

    def _init_args(self, caller: types.FrameType | None) -> dict[str, Any]:
        """The constructor's arguments: a dataclass's init fields (save_hyperparameters runs in
        its ``__post_init__``, as Lightning documents), else the calling ``__init__``'s."""
        if dataclasses.is_dataclass(self):
            return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        return _collect_init_args(caller)

    @property
    def hparams_name(self) -> str | None:
        """How the hparams were given: the ``__init__`` argument holding a dict / namespace passed
        to ``save_hyperparameters`` (reloading passes them back under it), else ``"kwargs"``
        (Lightning's ``hparams_name`` checkpoint entry)."""
        return self.__dict__.get("_hparams_name")

    @property
    def hparams(self) -> AttributeDict:
        if "_hparams" not in self.__dict__:
            object.__setattr__(self, "_hparams", AttributeDict())
        return self.__dict__["_hparams"]

    @property
    def hparams_initial(self) -> AttributeDict:
        """The hparams as saved (later edits of ``self.hparams`` do not change this)."""
        return AttributeDict(self.__dict__.get("_hparams_initial", {}))

    @property
    def logs_hyperparameters(self) -> bool:
        """Whether the loggers receive these hparams (``save_hyperparameters(logger=False)``: no)."""
        return bool(self.__dict__.get("_log_hyperparams", True)) and bool(self.hparams_initial)
