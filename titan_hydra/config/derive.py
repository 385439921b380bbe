"""A group's Hydra schema, derived from the class (or builder function) its ``_target_`` names.

That class is the one place a setting, its type and its default are written: the schema takes
its dataclass fields or its keyword parameters (the ``given`` ones, which the recipe passes when
it builds the object, are left out). A parameter without a default becomes MISSING. What the
schema adds: the ``_target_`` / ``_partial_`` keys Hydra needs, Choice enums for string settings
with a fixed set of values (made from the owner's own constants, so composing fails on a typo),
``links`` (a default that is another key, e.g. ``seq_len: ${training.seq_len}``) and ``extra``
keys that label the option without reaching the object (the data group's ``name``).
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Any, Callable, Iterable, Mapping, Optional

from omegaconf import MISSING

from titan_hydra.models.common.schema import omegaconf_type

NO_DEFAULT = inspect.Parameter.empty


def target_path(owner: Any) -> str:
    return f"{owner.__module__}.{owner.__qualname__}"


def owner_settings(owner: Any, given: Iterable[str] = ()) -> dict[str, tuple[Any, Any]]:
    """{name: (type hint, default or NO_DEFAULT)} of a dataclass's fields or a callable's keyword
    parameters, without the ``given`` ones and ``**kwargs``."""
    skip = set(given)
    if dataclasses.is_dataclass(owner):
        hints = typing.get_type_hints(owner)
        out = {}
        for f in dataclasses.fields(owner):
            if f.name in skip or not f.init:
                continue
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                default = NO_DEFAULT
            out[f.name] = (hints[f.name], default)
        return out
    hints = typing.get_type_hints(owner.__init__ if inspect.isclass(owner) else owner)
    params = inspect.signature(owner).parameters.values()
    return {p.name: (hints.get(p.name, Any), p.default) for p in params
            if p.name not in skip and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def schema_from(owner: Any, *, name: str, module: str, target: Any = None, partial: bool = False,
                given: Iterable[str] = (), choices: Optional[Mapping[str, type]] = None,
                links: Optional[Mapping[str, str]] = None, extra: Optional[Mapping[str, tuple[Any, Any]]] = None,
                doc: str = "") -> type:
    """The structured-config dataclass ``module.name`` (``module`` is where the caller binds it, so
    that it pickles into spawned workers). ``target`` (default: ``owner``; a class or its public
    dotted path) is what ``_target_`` names when the settings live on a separate dataclass
    (checkpoint's CheckpointSettings)."""
    choices, links, extra = dict(choices or {}), dict(links or {}), dict(extra or {})
    settings = owner_settings(owner, given)
    unknown = (set(choices) | set(links)) - set(settings)
    if unknown:
        raise TypeError(f"{name}: {sorted(unknown)} are not settings of {target_path(owner)}")
    target = target if isinstance(target, str) else target_path(target or owner)
    specs: list[tuple[str, Any, Any]] = [("_target_", str, dataclasses.field(default=target))]
    if partial:
        specs.append(("_partial_", bool, dataclasses.field(default=True)))
    for key, (hint, default) in extra.items():
        specs.append((key, hint, dataclasses.field(default=default)))
    for key, (hint, default) in settings.items():
        kind = omegaconf_type(hint)
        if key in choices:
            kind = choices[key] if default is not None else Optional[choices[key]]
            default = choices[key][default] if isinstance(default, str) else default
        if key in links:
            default = links[key]
        specs.append((key, kind, _field(default)))
    schema = dataclasses.make_dataclass(name, specs)
    schema.__module__ = module
    schema.__doc__ = doc or f"Hydra schema of {target_path(owner)}'s settings (derived by titan_hydra.config.derive)."
    return schema


def _field(default: Any) -> Any:
    if default is NO_DEFAULT:
        return dataclasses.field(default=MISSING)
    if isinstance(default, (list, tuple, Mapping)):  # a fresh container per config
        return dataclasses.field(default_factory=_copy_of(default))
    return dataclasses.field(default=default)


def _copy_of(value: Any) -> Callable[[], Any]:
    kind = dict if isinstance(value, Mapping) else list
    return lambda: kind(value)
