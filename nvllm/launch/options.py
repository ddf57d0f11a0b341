"""Click options generated from ``EngineConfig``'s fields.

Each engine setting's default and help live once, on the field (nvllm/common/config.py);
every command that starts an engine takes its options from here, so the command lines and
``LLM(...)`` cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Collection, Mapping
from typing import Any

import click

from nvllm.common.config import EngineConfig

# Fields that are not settings: the checkpoint is each command's own option, and the
# model's facts are read from it.
NOT_OPTIONS = frozenset({"model", "model_info", "source"})


def engine_fields(exclude: Collection[str] = ()) -> list[dataclasses.Field]:
    """EngineConfig's settings, in declaration order, less ``exclude``."""
    unknown = set(exclude) - {f.name for f in dataclasses.fields(EngineConfig)}
    if unknown:
        raise ValueError(f"not EngineConfig fields: {sorted(unknown)}")
    out = []
    for f in dataclasses.fields(EngineConfig):
        if f.name in NOT_OPTIONS or f.name in exclude:
            continue
        if "help" not in f.metadata:
            raise TypeError(f"EngineConfig.{f.name} has no help: declare it with _setting()")
        out.append(f)
    return out


def _value_type(annotation: Any) -> type:
    """``int | None`` -> ``int``: a flag's value is never None, only its default."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    if annotation not in (bool, int, float, str):
        raise TypeError(f"no command-line type for {annotation!r}")
    return annotation


def field_option(f: dataclasses.Field, hints: Mapping[str, Any],
                 help: str | None = None) -> Callable:
    """One click option for field ``f``: ``--field-name`` plus its declared aliases.

    Booleans that default on get a ``--x/--no-x`` pair; those that default off are plain
    flags, so ``--enforce-eager`` reads as it always has.
    """
    meta = f.metadata
    own = "--" + f.name.replace("_", "-")
    names = list(meta.get("flags", ()))
    if own not in names:
        names.append(own)
    kind = str if meta.get("json") else _value_type(hints[f.name])  # JSON: parsed later
    kw: dict[str, Any] = {"default": f.default, "help": help or meta["help"],
                          "show_default": True}
    if kind is bool:
        if f.default:
            names = [f"{n}/--no-{n[2:]}" for n in names]
        else:
            kw["is_flag"] = True
    else:
        kw["type"] = click.Choice(meta["choices"]) if "choices" in meta else kind
    return click.option(*names, f.name, **kw)


def engine_options(exclude: Collection[str] = (),
                   help: Mapping[str, str] | None = None) -> Callable:
    """Decorator: add one option per EngineConfig setting (less ``exclude``) to a click
    command, and hand the command their values as one dict, ``engine_kwargs``, ready for
    ``LLM(model, **engine_kwargs)``. ``help`` replaces a field's help where a command gives
    it another meaning (e.g. a different default when None)."""
    fields = engine_fields(exclude)
    hints = typing.get_type_hints(EngineConfig)
    help = dict(help or {})
    unknown = set(help) - {f.name for f in fields}
    if unknown:
        raise ValueError(f"help for fields without an option: {sorted(unknown)}")

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            engine_kwargs = {f.name: kwargs.pop(f.name) for f in fields}
            return fn(*args, engine_kwargs=engine_kwargs, **kwargs)

        for f in reversed(fields):
            wrapper = field_option(f, hints, help.get(f.name))(wrapper)
        return wrapper

    return decorate
