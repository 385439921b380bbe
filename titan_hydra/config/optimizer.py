"""The ``optimizer`` group: its schema, and the typed settings ``train/optimizers.py`` builds from.

The node is a torch optimizer class (``_target_``) with its hyper-parameters, plus an optional
list ``param_groups``: each group selects parameters by name and shape and overrides settings for
them, or names another optimizer class for them (the format is ``train/optimizers.py``'s
docstring). ``OptimizerSettings.of`` reads a node once into typed values, refusing what no
optimizer could take in one line, so the ``RunSpec`` carries settings rather than a config node.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Mapping, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf

from titan_hydra.errors import ConfigError

SELECTORS = ("name", "match", "ndim", "optional")  # what picks a group's parameters, not a setting


@dataclass
class OptimizerConfig:
    """The ``optimizer`` group's schema: the node ``OptimizerSettings.of`` reads, with the defaults
    the recipe trains with. Written here rather than derived from ``_target_``: the target is any
    torch optimizer class (AdamW, Adam, SGD, ...), the schema is the union of their settings, a
    null one is not passed (left to the class), and torch's own AdamW defaults (lr 1e-3, betas
    (0.9, 0.999), weight_decay 0.01) are not the ones titan_hydra trains with."""

    _target_: str = "torch.optim.AdamW"
    _partial_: bool = True
    lr: float = 8e-4
    betas: Optional[List[float]] = field(default_factory=lambda: [0.9, 0.95])
    eps: Optional[float] = 1e-8
    weight_decay: float = 0.1
    momentum: Optional[float] = None  # SGD's (null settings are not passed to the optimizer)
    foreach: Optional[bool] = None
    # null: fused where the optimizer class has a fused kernel for the parameters' device (AdamW,
    # Adam, SGD, Adagrad on CPU and CUDA), as torchtitan does; torch's own CPU default is a loop
    fused: Optional[bool] = None
    # per-group settings / other optimizers by parameter name and shape (train/optimizers.py):
    # [{name, match: [fnmatch FQN patterns], ndim, optional (dropped if it selects nothing), _target_?, <settings>}]
    param_groups: List[Any] = field(default_factory=list)


def _plain(node: Any) -> Any:
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=True, enum_to_str=True)
    return node


def optimizer_kwargs(node: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments a node's optimizer class receives: every setting but the selectors,
    ``_target_``-style keys and ``param_groups``; a null one is one this optimizer does not take
    (SGD has no betas): left to the class's default."""
    out = {k: v for k, v in node.items()
           if not k.startswith("_") and k not in SELECTORS and k != "param_groups" and v is not None}
    if isinstance(out.get("betas"), list):
        out["betas"] = tuple(out["betas"])
    return out


@dataclass(frozen=True)
class ParamGroupSettings:
    """One ``optimizer.param_groups`` entry: which parameters (fnmatch patterns over the FQN, and
    the dimensions), the optimizer class for them (None: the top-level one, as a param group of
    it), and the settings that group overrides or its own class takes."""

    name: str
    match: tuple[str, ...] = ("*",)
    ndim: Optional[tuple[int, ...]] = None
    target: Optional[str] = None
    settings: Mapping[str, Any] = field(default_factory=dict)
    optional: bool = False  # dropped, not refused, when it selects no parameter (the option files' defaults)

    @classmethod
    def of(cls, node: Mapping[str, Any], index: int) -> ParamGroupSettings:
        if not node.get("name"):
            raise ConfigError(f"optimizer.param_groups[{index}] needs a name (and match / ndim to select parameters)")
        patterns = node.get("match") or ["*"]
        ndim = node.get("ndim")
        return cls(name=str(node["name"]), match=tuple([patterns] if isinstance(patterns, str) else patterns),
                   ndim=None if ndim is None else tuple(int(n) for n in (ndim if isinstance(ndim, (list, tuple)) else [ndim])),
                   target=None if node.get("_target_") is None else str(node["_target_"]),
                   settings=optimizer_kwargs(node), optional=bool(node.get("optional", False)))


@dataclass(frozen=True)
class OptimizerSettings:
    """The ``optimizer`` node as typed values: the class, its top-level settings and the groups."""

    target: str
    lr: Optional[float] = None  # (None: a node made by hand without one; the class's default)
    weight_decay: Optional[float] = None
    betas: Optional[tuple[float, ...]] = None
    eps: Optional[float] = None
    momentum: Optional[float] = None
    foreach: Optional[bool] = None
    fused: Optional[bool] = None
    param_groups: tuple[ParamGroupSettings, ...] = ()
    # settings of the class beyond the schema's (a node built by hand): passed on as they are
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Values a constructor would refuse with a traceback (AdamW betas) or accept and train wrong
        with, refused in one line however the settings were made."""
        if self.lr is not None and not self.lr > 0:
            raise ConfigError(f"optimizer.lr={self.lr} must be > 0")
        for key in ("weight_decay", "eps"):
            value = getattr(self, key)
            if value is not None and value < 0:
                raise ConfigError(f"optimizer.{key}={value} must be >= 0")
        if self.betas is not None and not all(0.0 <= float(b) < 1.0 for b in self.betas):
            raise ConfigError(f"optimizer.betas={list(self.betas)} must each be within [0, 1)")

    @classmethod
    def of(cls, node: Any) -> OptimizerSettings:
        """The settings of an ``optimizer`` node (a composed config node or a plain mapping)."""
        node = _plain(node)
        kwargs = optimizer_kwargs(node)
        typed = {k: kwargs.pop(k) for k in ("lr", "weight_decay", "betas", "eps", "momentum", "foreach", "fused")
                 if k in kwargs}
        groups = tuple(ParamGroupSettings.of(g, i) for i, g in enumerate(node.get("param_groups") or []))
        return cls(target=str(node.get("_target_")), param_groups=groups, extra=kwargs, **typed)

    def kwargs(self) -> dict[str, Any]:
        """What the top-level class receives (its null settings left to the class)."""
        out = {k: getattr(self, k) for k in ("lr", "weight_decay", "betas", "eps", "momentum", "foreach", "fused")
               if getattr(self, k) is not None}
        return {**out, **self.extra}
