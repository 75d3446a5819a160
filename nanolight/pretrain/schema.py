"""Turn a composed Hydra/OmegaConf tree into typed dataclass configs, with fix-it errors.

Hydra composes YAML; it does not know our schemas. Every section of the recipe config is
checked here against the dataclass of the component it configures (the schema lives next to
that component), so a misspelled key, a wrong type or an impossible value fails in the parent
process with a message that names the key and the valid choices, before any rank is spawned.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, TypeVar

from nanolight.errors import UsageError

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


def check_override_keys(cls: type, overrides: list[str], groups: tuple[str, ...] = ()) -> None:
    """Reject command-line overrides whose key is not in the schema, before Hydra composes.

    Hydra's own message for `trainer.max_step=5` suggests appending the key with `+`; ours names
    the valid keys instead. Group choices (`model=...`) and `hydra.*` keys are left to Hydra.
    """
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
