"""Every ``_target_`` a user can set, checked against what its group builds before anything runs.

Hydra instantiates whatever importable callable a ``_target_`` names (its own blocklist refuses
only execution-capable ones such as ``os.system``), so ``lr_scheduler._target_=os.getcwd`` would
otherwise surface as a TypeError traceback after the model is built. Here, right after composing:
each ``_target_`` in the config must import and, where its node has a schema, build what its group builds: the class the
group's schema names by default (its ``_target_`` field), a subclass of it, or of the group's
wider kind (``KINDS``: any torch optimizer, any LR schedule, any ``nn.Module``), or a function
whose return annotation is one of those; a metrics backend only needs a ``log`` method
(``DUCK``). Anything else is one line naming the group and what it expects.

What a group builds is read from the config itself (the node's structured schema), so this module
knows no class of a higher layer; the classes are resolved from their names when checked.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Iterator

from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf

from titan_hydra.errors import ConfigError, first_line

# group -> wider kinds its target may build besides the schema default's (a user's own optimizer...)
KINDS: dict[str, tuple[str, ...]] = {
    "model": ("torch.nn.Module",),
    "optimizer": ("torch.optim.Optimizer",),
    # the group's own settings classes, also for a saved run config read back without its schema
    "lr_scheduler": ("titan_hydra.schedules.WarmupDecay", "titan_hydra.schedules.CooldownSchedule",
                     "torch.optim.lr_scheduler.LRScheduler"),
}
# group -> methods that make a class acceptable whatever it derives from (MetricLogger calls only these)
DUCK: dict[str, tuple[str, ...]] = {"logger": ("log",)}


def targets_of(cfg: DictConfig, prefix: str = "") -> Iterator[tuple[str, DictConfig]]:
    """(path, node) of every node of ``cfg`` with a ``_target_`` ("lr_scheduler", "logger.wandb")."""
    for key in cfg.keys():
        if not prefix and key == "hydra":  # Hydra's own node (its launcher, sweeper): Hydra checks it
            continue
        if key == "_target_":
            yield prefix, cfg
            continue
        child = cfg._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            yield from targets_of(cfg[key], f"{prefix}.{key}" if prefix else str(key))


def built_kind(obj: Any) -> type | None:
    """What calling ``obj`` builds: the class itself, or a function's return annotation (None: unknown)."""
    if isinstance(obj, type):
        return obj
    if not callable(obj):
        return None
    try:
        kind = typing.get_type_hints(obj).get("return")
    except Exception:  # noqa: BLE001  (an annotation that does not resolve: unknown)
        return None
    if typing.get_origin(kind) in (typing.Union, types.UnionType):  # ``Profiler | None``: what it builds when on
        built = [a for a in typing.get_args(kind) if a is not type(None)]
        kind = built[0] if len(built) == 1 else None
    return kind if isinstance(kind, type) else None


def default_target(node: DictConfig) -> str | None:
    """The ``_target_`` the node's schema names by default (None for a node without a schema)."""
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return None
    default = {f.name: f.default for f in dataclasses.fields(schema)}.get("_target_")
    return default if isinstance(default, str) else None


def expected_kinds(group: str, node: DictConfig) -> list[type]:
    """The classes a target of this node may build (the most general ones)."""
    names = [n for n in (default_target(node), *KINDS.get(group, ())) if n]
    kinds = [k for k in (built_kind(get_object(n)) for n in names) if k is not None]
    return [k for k in kinds if not any(o is not k and issubclass(k, o) for o in kinds)]


def _name(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


def check_target(path: str, node: DictConfig) -> None:
    """ConfigError (one line) unless ``node._target_`` builds what the group at ``path`` builds."""
    target = node._target_
    group = path.split(".")[0]
    try:
        obj = get_object(str(target))
    except Exception as e:  # noqa: BLE001  (not importable, or refused by Hydra's own blocklist)
        raise ConfigError(f"{path}._target_={target} cannot be used: {first_line(e)}") from None
    expected = expected_kinds(group, node)
    kind = built_kind(obj)
    duck = DUCK.get(group, ())
    if kind is not None and duck and all(callable(getattr(kind, m, None)) for m in duck):
        return
    if kind is not None and expected and issubclass(kind, tuple(expected)):
        return
    default = default_target(node)
    if not expected and default in (None, str(target)):
        return  # a node without a schema (its parent's business), or a default that does not say what it builds
    if not expected:
        raise ConfigError(f"{path}._target_={target}: the {group} group's default builder {default} "
                          "does not say what it builds (no return annotation), so no other target can be checked")
    wants = " or ".join(dict.fromkeys(_name(k) for k in expected)) + (f" (or any class with {', '.join(duck)}())" if duck else "")
    what = (f"it builds a {_name(kind)}" if kind is not None else
            "it is a function without a return annotation" if callable(obj) else "it is not callable")
    raise ConfigError(f"{path}._target_={target} is not what the {group} group builds: it expects a {wants} "
                      f"(that class, a subclass, or a function annotated to return one); {what}")


def check_targets(cfg: DictConfig) -> None:
    """Every ``_target_`` of the composed config against its group (the first wrong one raises)."""
    for path, node in targets_of(cfg):
        check_target(path, node)
