"""Turn a composed Hydra/OmegaConf tree into typed dataclass configs, with fix-it errors, and
report nanolight's errors at the command line as one line (`reported_errors`).

Hydra composes YAML; it does not know our schemas. Every section of the recipe config is
checked here against the dataclass of the component it configures (the schema lives next to
that component), so a misspelled key, a wrong type or an impossible value fails in the parent
process with a message that names the key and the valid choices, before any rank is spawned.

Entry points (the recipe, `scripts/plan.py`) print them once: ``nanolight: error: ...``. Every
error nanolight raises on purpose (`nanolight.errors.NanolightError`: a config, a layout, a
checkpoint, the data, a full disk, a silent peer) already says what is wrong and how to fix it,
so a traceback through Hydra and torch only buries it. Under torchrun every rank raises the same
error: rank 0 prints it (and a rank whose error is its own, e.g. its disk is full). Anything else
is a bug and keeps its traceback. ``--debug`` (or ``HYDRA_FULL_ERROR=1``) shows the traceback of
nanolight's errors too.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import time
import types
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch.distributed as dist

from nanolight.errors import NanolightError, UsageError
from nanolight.parallel.environment import detect_environment
from nanolight.parallel.health import PeerError, publish_error

T = TypeVar("T")


class ConfigError(UsageError):
    """A recipe config that cannot run. The message says which key and how to fix it."""


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against annotation `tp`, converting the lossless cases (int -> float)."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arm in typing.get_args(tp):
            try:
                return _coerce(value, arm, key)
            except ConfigError as err:
                errors.append(err)
        raise ConfigError(f"`{key}` = {value!r} must be {_type_name(tp)}")
    if origin is typing.Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"`{key}` = {value!r} is not one of {list(choices)}")
        return value
    if tp is type(None):
        if value is not None:
            raise ConfigError(f"`{key}` must be null")
        return None
    if origin in (dict, typing.Dict) or tp is dict:  # noqa: UP006
        if not isinstance(value, dict):
            raise ConfigError(f"`{key}` = {value!r} must be a mapping")
        return value
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"`{key}` = {value!r} must be a list")
        return type(value)(value) if origin is None else (origin)(value)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is bool and not isinstance(value, bool):
        raise ConfigError(f"`{key}` = {value!r} must be true or false")
    if tp is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"`{key}` = {value!r} must be an integer")
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"`{key}` = {value!r} must be {_type_name(tp)}")
    return value


def build_dataclass(cls: type[T], values: dict[str, Any] | None, prefix: str) -> T:
    """Instantiate dataclass `cls` from a plain dict, rejecting unknown keys by name.

    Nested dataclass fields are built recursively; `__post_init__` (each component's own
    validation) runs as usual and its ValueError is re-raised as a ConfigError with the prefix.
    """
    values = dict(values or {})
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in values if k not in fields]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, list(fields), n=1)
        hint = f" Did you mean `{prefix}{close[0]}`?" if close else ""
        raise ConfigError(
            f"unknown config key `{prefix}{key}`.{hint} Valid keys of `{prefix.rstrip('.') or 'config'}`: "
            f"{', '.join(sorted(fields))}."
        )
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in values.items():
        tp = hints.get(name, Any)
        if dataclasses.is_dataclass(tp) and (isinstance(value, dict) or value is None):
            kwargs[name] = build_dataclass(tp, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, tp, f"{prefix}{name}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as err:
        raise ConfigError(f"invalid `{prefix.rstrip('.') or cls.__name__}` config: {err}") from err


def check_override_syntax(overrides: list[str]) -> None:
    """Each override must parse as Hydra's grammar: its parser's error is three lines and a hint
    at HYDRA_FULL_ERROR; ours is one, naming the override."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    for arg in overrides:
        if arg.startswith("-") or "=" not in arg:  # Hydra's flags and their values (--cfg job)
            continue
        try:
            parser.parse_overrides([arg])
        except OverrideParseException as err:
            raise ConfigError(
                f"cannot parse the override {arg!r} ({str(err).splitlines()[0]}): write key=value, quoting a "
                "value with brackets, spaces or commas, e.g. 'data.path=\"a b\"'"
            ) from None


def check_override_keys(cls: type, overrides: list[str], groups: tuple[str, ...] = ()) -> None:
    """Reject command-line overrides whose key is not in the schema, before Hydra composes.

    Hydra's own message for `trainer.max_step=5` suggests appending the key with `+`; ours names
    the valid keys instead. Group choices (`model=...`) and `hydra.*` keys are left to Hydra.
    """
    check_override_syntax(overrides)
    for arg in overrides:
        if arg.startswith("-") or "=" not in arg:
            continue
        key = arg.split("=", 1)[0].lstrip("+~")
        if key in groups or key.split(".", 1)[0] == "hydra" or "@" in key:
            continue
        owner, prefix = cls, ""
        for part in key.split("."):
            if not (isinstance(owner, type) and dataclasses.is_dataclass(owner)):
                break  # below a free-form field (a dict such as model.rope_scaling): not ours to check
            fields = {f.name for f in dataclasses.fields(owner) if f.init}
            if part not in fields:
                close = difflib.get_close_matches(part, sorted(fields), n=1)
                hint = f" Did you mean `{prefix}{close[0]}`?" if close else ""
                where = f"`{prefix.rstrip('.')}`" if prefix else "the config"
                raise ConfigError(
                    f"unknown config key `{prefix}{part}`.{hint} Valid keys of {where}: {', '.join(sorted(fields))}."
                )
            owner = typing.get_type_hints(owner).get(part)
            prefix += part + "."


DEBUG_FLAG = "--debug"
ERROR_GRACE_S = 3.0  # how long a silent rank waits before exiting on an error every rank found


def take_debug_flag(argv: list[str]) -> bool:
    """Remove ``--debug`` from `argv` (Hydra would reject it); children inherit HYDRA_FULL_ERROR."""
    if DEBUG_FLAG in argv:
        argv.remove(DEBUG_FLAG)
        os.environ["HYDRA_FULL_ERROR"] = "1"
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def _rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    env = detect_environment()
    return env.rank if env is not None else 0


@contextmanager
def reported_errors(debug: bool = False) -> Iterator[None]:
    """Run the body; a `NanolightError` becomes one line on stderr and exit status 2 (a config
    error) or 1, Ctrl-C one line and 130. With `debug` the traceback is printed as usual."""
    try:
        yield
    except KeyboardInterrupt:  # Ctrl-C outside training (inside, `Preemption` saves first)
        if debug:
            raise
        if _rank() == 0:
            print(
                "nanolight: interrupted (Ctrl-C); checkpoints saved so far are kept",
                file=sys.stderr,
                flush=True,
            )
        sys.exit(130)
    except NanolightError as err:
        if not isinstance(err, PeerError):  # a peer blocked on this rank prints it first
            publish_error(str(err))
        if debug:
            raise
        if _rank() == 0 or err.rank_specific:
            print(f"nanolight: error: {err}", file=sys.stderr, flush=True)
        else:
            # every rank found the same error; torchrun stops the others as soon as one exits, so
            # the ones that stay silent leave rank 0 a moment to say it first
            time.sleep(ERROR_GRACE_S)
        sys.exit(2 if isinstance(err, ConfigError) else 1)
