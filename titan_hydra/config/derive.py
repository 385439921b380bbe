"""Every Hydra schema, derived from the class (or builder function) its ``_target_`` names.

That class is the one place a setting, its type and its default are written: the schema takes
its dataclass fields or its keyword parameters (the ``given`` ones, which the recipe passes when
it builds the object, are left out). A parameter without a default becomes MISSING. What the
schema adds: the ``_target_`` / ``_partial_`` keys Hydra needs, Choice enums for string settings
with a fixed set of values (made from the owner's own constants, so composing fails on a typo),
``links`` (a default that is another key, e.g. ``seq_len: ${training.seq_len}``) and ``labels``:
keys that name the chosen option without reaching the object (data's ``name``, a model's
``family`` / ``flavor``). A field holding another dataclass (``moe: MoEArgs | dict``) becomes a
sub-node typed by that dataclass's own derived schema.

It lives in ``config/`` because it needs only OmegaConf and the owner class handed to it: the
layer that registers schemas (``titan_hydra.groups``, above every owner) calls it for the group
owners and the model families alike, so no owner package carries schema code of its own.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import inspect
import sys
import types
import typing
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

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
                links: Optional[Mapping[str, str]] = None, labels: Optional[Mapping[str, tuple[Any, Any]]] = None,
                doc: str = "") -> type:
    """The structured-config dataclass ``module.name``, bound there (so that a config holding it
    pickles into spawned workers); a sub-node's schema is bound beside it as ``name_<field>``.
    ``target`` (default: ``owner``; a class or its public dotted path) is what ``_target_`` names
    when the settings live on a separate dataclass (checkpoint's CheckpointSettings, a model
    family's args); False for none (a sub-node)."""
    choices, links, labels = dict(choices or {}), dict(links or {}), dict(labels or {})
    settings = owner_settings(owner, given)
    unknown = (set(choices) | set(links)) - set(settings)
    if unknown:
        raise TypeError(f"{name}: {sorted(unknown)} are not settings of {target_path(owner)}")
    specs: list[tuple[str, Any, Any]] = []
    if target is not False:
        target = target if isinstance(target, str) else target_path(target or owner)
        specs.append(("_target_", str, dataclasses.field(default=target)))
    if partial:
        specs.append(("_partial_", bool, dataclasses.field(default=True)))
    for key, (hint, default) in labels.items():
        specs.append((key, hint, dataclasses.field(default=default)))
    for key, (hint, default) in settings.items():
        sub = nested_dataclass(hint)
        if sub is not None:
            node = schema_from(sub, name=f"{name}_{key}", module=module, target=False)
            specs.append((key, node, dataclasses.field(default_factory=node)))
            continue
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
    schema._derived_from = owner  # what the schema says it mirrors (tests/test_groups.py checks it)
    setattr(sys.modules[module], name, schema)
    return schema


def nested_dataclass(hint: Any) -> Optional[type]:
    """The dataclass a field holds as a sub-node: ``Args``, or ``Args | dict`` (an owner that
    takes either); None for any other type."""
    union = typing.get_origin(hint) in (types.UnionType, typing.Union)
    options = typing.get_args(hint) if union else (hint,)
    classes = [a for a in options if dataclasses.is_dataclass(a)]
    others = [a for a in options if a not in classes and a is not dict
              and typing.get_origin(a) not in (dict, collections.abc.Mapping)]
    return classes[0] if len(classes) == 1 and not others else None


def omegaconf_type(hint: Any) -> Any:
    """The annotation OmegaConf checks for a Python type hint: ``X | None`` -> ``Optional[X]``,
    any sequence of X (``list[X]``, ``tuple[X, ...]``, ``Sequence[X]``) -> ``List[X]``,
    ``dict[K, V]`` / ``Mapping[K, V]`` -> ``Dict[K, V]``."""
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        others = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(others) != 1:
            raise TypeError(f"a schema field cannot be the union {hint}; give it a nested schema")
        return Optional[omegaconf_type(others[0])]
    if origin in (list, tuple, collections.abc.Sequence, collections.abc.Iterable):
        item = typing.get_args(hint)[0]
        return List[omegaconf_type(item)]
    if origin in (dict, collections.abc.Mapping):
        key, value = typing.get_args(hint)
        return Dict[key, omegaconf_type(value)]
    return hint


def _field(default: Any) -> Any:
    if default is NO_DEFAULT:
        return dataclasses.field(default=MISSING)
    if isinstance(default, (list, tuple, Mapping)):  # a fresh container per config
        return dataclasses.field(default_factory=_copy_of(default))
    return dataclasses.field(default=default)


def _copy_of(value: Any) -> Callable[[], Any]:
    kind = dict if isinstance(value, Mapping) else list
    return lambda: kind(value)


def with_open_maps(schema: type) -> Any:
    """``schema`` as the node Hydra stores, each free-form map in it (a ``Dict[str, Any]`` setting:
    transformers' config fields, named data sources, base shapes) open: its keys are the user's, so
    ``model.fields.rope_theta=1e4`` and ``model.fields={hidden_size: 64}`` add keys without Hydra's ``+``
    while every other key stays checked. (Struct mode is a flag OmegaConf keeps per node; the schema's
    dataclass cannot carry it, its node can.)"""
    node = OmegaConf.structured(schema)

    def open_maps(n: DictConfig) -> None:
        for key in n.keys():
            child = n._get_node(key)
            if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
                if child._metadata.object_type is dict and child._metadata.element_type is Any:
                    OmegaConf.set_struct(child, False)
                else:
                    open_maps(child)

    open_maps(node)
    return node
