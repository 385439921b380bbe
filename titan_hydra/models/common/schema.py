"""A family's Hydra schema, derived from its args dataclass, so that the two cannot drift.

The args dataclass (``LlamaArgs``, ``MoEArgs``, ...) is the one place a field, its type and its
default are written. Its shape fields have no default: they become MISSING in the schema, so a
flavor's shape lives in its ``conf/model/*.yaml`` only. The schema adds the keys Hydra needs
(``_target_``, ``family``, ``flavor``) and turns Python types into the ones OmegaConf checks
(``int | None`` -> ``Optional[int]``, ``list[str]`` -> ``List[str]``, a nested args dataclass ->
its own derived schema).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import types
import typing
from typing import Any, Dict, List, Optional

from omegaconf import MISSING


def schema_of(args_cls: type, *, name: str, module: str, target: str | None = None, family: str | None = None,
              nested: dict[str, type] | None = None) -> type:
    """The structured-config dataclass ``module.name`` for ``args_cls`` (``module`` is where the caller
    binds it, so that the class pickles into spawned workers). ``target``/``family`` add the model
    node's ``_target_``/``family``/``flavor`` keys; ``nested`` maps a field to the schema of its
    sub-node (e.g. ``{"moe": MoEConfig}``)."""
    nested = nested or {}
    hints = typing.get_type_hints(args_cls)
    specs: list[tuple[str, Any, Any]] = []
    if target is not None:
        specs += [("_target_", str, dataclasses.field(default=target)),
                  ("family", str, dataclasses.field(default=family)),
                  ("flavor", str, dataclasses.field(default="custom"))]
    for f in dataclasses.fields(args_cls):
        if f.name in nested:
            specs.append((f.name, nested[f.name], dataclasses.field(default_factory=nested[f.name])))
        elif f.default is not dataclasses.MISSING:
            specs.append((f.name, omegaconf_type(hints[f.name]), dataclasses.field(default=f.default)))
        elif f.default_factory is not dataclasses.MISSING:
            specs.append((f.name, omegaconf_type(hints[f.name]), dataclasses.field(default_factory=f.default_factory)))
        else:
            specs.append((f.name, omegaconf_type(hints[f.name]), dataclasses.field(default=MISSING)))
    schema = dataclasses.make_dataclass(name, specs)
    schema.__module__ = module
    schema.__doc__ = f"Hydra schema of {args_cls.__name__} (titan_hydra.models.common.schema derives it)."
    return schema


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
