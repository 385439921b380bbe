"""The ``optimizer`` config node -> one torch optimizer, or several behind one interface.

The node is a torch optimizer class (``_target_``) with its hyper-parameters, plus an optional
list ``param_groups``: each group selects parameters by name and shape and overrides settings
for them::

    _target_: torch.optim.AdamW          # the parameters no group selects
    lr: 8e-4
    weight_decay: 0.1
    param_groups:
      - name: no_weight_decay
        ndim: 1                          # norms, biases, sinks
        weight_decay: 0.0
      - name: matrices
        match: ["layers.*"]              # fnmatch over the parameter's FQN
        ndim: 2
        _target_: titan_hydra.train.muon.Muon   # another optimizer: only its own settings apply
        lr: 0.02

The node is read once into typed settings (``config/optimizer.OptimizerSettings``, beside the
group's schema ``OptimizerConfig``): the spec carries them. A group without ``_target_``
becomes a param group of the top-level optimizer (its keys override the top-level ones); a
group with its own ``_target_`` gets its own optimizer instance built from the group's keys alone (another class may not take the top-level ones). Every parameter
belongs to at most one group: a parameter two groups select, or a group that selects nothing,
is a one-line ``ConfigError`` (a typo in a pattern must not silently train with the defaults),
unless the group says ``optional: true``: the option files' default groups do (OLMo v1's
LayerNorms have no weights, so ``no_weight_decay`` finds nothing there, and a default must not
refuse an architecture); such a group is dropped.

With one optimizer class the result is that optimizer itself. With several, ``OptimizerList``
runs them as one: its ``param_groups`` are the members' own group dicts (so one LR schedule
drives every group, and checkpoints restore them), ``step``/``zero_grad`` call every member,
and ``optimizers`` lists them for distributed checkpointing (DCP keys optimizer state by
parameter FQN, so the members' states never collide).
"""

from __future__ import annotations

import fnmatch
import inspect
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from hydra.utils import get_class
from torch.distributed.tensor import DTensor
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from titan_hydra.config.optimizer import OptimizerSettings, ParamGroupSettings
from titan_hydra.errors import ConfigError
from titan_hydra.models.parametrization import Geometry
from titan_hydra.train.width_scaling import split_group

# wrapper segments that activation checkpointing / torch.compile may add to an FQN
_WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.")


def clean_name(fqn: str) -> str:
    for w in _WRAPPERS:
        fqn = fqn.replace(w, "")
    return fqn


def _selects(group: ParamGroupSettings, name: str, p: torch.Tensor) -> bool:
    if not any(fnmatch.fnmatchcase(name, pat) for pat in group.match):
        return False
    return group.ndim is None or p.ndim in group.ndim


def with_implementation(cls: type, kwargs: dict[str, Any], params: list[torch.Tensor]) -> dict[str, Any]:
    """``kwargs`` plus ``fused=True`` where the optimizer has a fused kernel for these parameters
    and the config chose neither ``fused`` nor ``foreach`` (torchtitan's default, too).

    torch's own default on CPU is the per-tensor loop: AdamW over the 302M parameters of
    torchtitan's Qwen3-MoE debug shape stepped in 1.25 s on 2 cores, fused in 0.17 s (foreach
    0.83 s). ``optimizer.fused=false`` (or ``foreach=true``) keeps torch's choice. DTensor
    parameters (FSDP, TP, DDP layouts) have fused kernels for Adam and AdamW only (torch 2.13 has
    no sharding rule for ``_fused_sgd_``).
    """
    if "fused" in kwargs or "foreach" in kwargs or "fused" not in inspect.signature(cls.__init__).parameters:
        return kwargs
    supported = _get_fused_kernels_supported_devices()
    if not params or not all(p.is_floating_point() and p.device.type in supported for p in params):
        return kwargs
    if not issubclass(cls, (torch.optim.Adam, torch.optim.AdamW)) and any(isinstance(p, DTensor) for p in params):
        return kwargs
    if len({isinstance(p, DTensor) for p in params}) > 1:
        # plain parameters beside DTensors (model=hf: an MoE block runs whole on every TP rank): a
        # fused kernel takes one kind per call, torch's per-tensor loop takes both
        return kwargs
    return {**kwargs, "fused": True}


def _optimizer_class(target: str, where: str) -> type:
    try:
        cls = get_class(target)
    except Exception:  # noqa: BLE001  (hydra raises several kinds for a bad path)
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError(f"{where}._target_={target!r} is not a torch.optim.Optimizer class")
    return cls


def assign_groups(groups: tuple[ParamGroupSettings, ...], named_params: list[tuple[str, torch.Tensor]]
                  ) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[ParamGroupSettings, list[tuple[str, torch.Tensor]]]]]:
    """(parameters no group selects, [(group, its parameters)]), each parameter with its name
    (wrappers removed), with the one-line checks."""
    chosen: list[list[tuple[str, torch.Tensor]]] = [[] for _ in groups]
    rest: list[tuple[str, torch.Tensor]] = []
    for fqn, p in named_params:
        name = clean_name(fqn)
        hits = [i for i, group in enumerate(groups) if _selects(group, name, p)]
        if len(hits) > 1:
            a, b = (groups[i].name for i in hits[:2])
            raise ConfigError(f"optimizer.param_groups {a!r} and {b!r} both select parameter {name!r}; "
                              "narrow their match / ndim so that each parameter has one group")
        if hits:
            chosen[hits[0]].append((name, p))
        else:
            rest.append((name, p))
    kept = [(group, params) for group, params in zip(groups, chosen) if params or not group.optional]
    for group, params in kept:
        if not params:
            raise ConfigError(f"optimizer.param_groups {group.name!r} selects no parameter (match="
                              f"{list(group.match)}, ndim={_ndim_text(group.ndim)}); fix the pattern or drop the group")
    return rest, kept


def _ndim_text(ndim: tuple[int, ...] | None) -> Any:
    """A group's ``ndim`` as the config wrote it, for the message (one value, a list, or None)."""
    return ndim if ndim is None or len(ndim) > 1 else ndim[0]


def build_optimizer(settings: OptimizerSettings | Mapping[str, Any], named_params: list[tuple[str, torch.Tensor]],
                    geometry: Mapping[str, Geometry] | None = None) -> torch.optim.Optimizer:
    """The optimizer(s) the ``optimizer`` settings describe (or a node of them: read with
    ``OptimizerSettings.of``), over ``named_params`` (FQN, parameter). ``geometry`` (a width
    parametrization's, ``models/parametrization.py``): each group is split by its parameters' muP
    LR / decay multipliers (``width_scaling.py``); None or empty (sp): the groups exactly as configured."""
    s = settings if isinstance(settings, OptimizerSettings) else OptimizerSettings.of(settings)
    geometry = geometry or {}
    default_cls = _optimizer_class(s.target, "optimizer")
    default_kwargs = s.kwargs()
    rest, groups = assign_groups(s.param_groups, named_params)
    own: list[tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]] = [({}, rest)] if rest else []
    others: list[torch.optim.Optimizer] = []
    for group, named in groups:
        if group.target is None or get_class(group.target) is default_cls:
            own.append(({**group.settings, "group_name": group.name}, named))
        else:
            cls = _optimizer_class(group.target, f"optimizer.param_groups {group.name!r}")
            params = [p for _, p in named]
            kwargs = dict(group.settings)
            try:
                others.append(cls(split_group({"group_name": group.name}, named, cls, kwargs, geometry),
                                  **with_implementation(cls, kwargs, params)))
            except (TypeError, ValueError) as e:
                raise ConfigError(f"optimizer.param_groups {group.name!r}: {e}") from None
    optimizers = []
    if own:
        if rest and len(own) > 1:
            own[0][0]["group_name"] = "default"
        param_groups = [g for group, named in own
                        for g in split_group(group, named, default_cls, {**default_kwargs, **group}, geometry)]
        try:
            all_params = [p for g in param_groups for p in g["params"]]
            optimizers.append(default_cls(param_groups, **with_implementation(default_cls, default_kwargs, all_params)))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"optimizer ({s.target}): {e}") from None
    optimizers.extend(others)
    return optimizers[0] if len(optimizers) == 1 else OptimizerList(optimizers)


class _MergedState(Mapping):
    """Read-only view of the members' ``state`` (their parameters are disjoint)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self._optimizers = optimizers

    def __getitem__(self, key):
        for o in self._optimizers:
            if key in o.state:
                return o.state[key]
        raise KeyError(key)

    def __iter__(self) -> Iterator:
        for o in self._optimizers:
            yield from o.state

    def __len__(self) -> int:
        return sum(len(o.state) for o in self._optimizers)


class OptimizerList(torch.optim.Optimizer):
    """Several optimizers (e.g. Muon for matrices, AdamW for the rest) stepped as one."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = list(optimizers)  # what titan_hydra.checkpoint.state.members hands to DCP
        params = [p for o in self.optimizers for g in o.param_groups for p in g["params"]]
        self._ready = False
        super().__init__(params, {})  # hooks and bookkeeping of the base class (on a scratch group list)
        self._ready = True

    # Views, recomputed on every access: a member's ``load_state_dict`` (checkpoint resume)
    # replaces its group dicts, and a stored list would leave the LR schedule driving the old ones.
    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        if not self.__dict__.get("_ready"):
            return self.__dict__.setdefault("_scratch_groups", [])
        return [g for o in self.optimizers for g in o.param_groups]

    @param_groups.setter
    def param_groups(self, value) -> None:  # only the base class's __init__ assigns: the members own the groups
        self.__dict__["_scratch_groups"] = value

    @property  # type: ignore[override]
    def state(self) -> Mapping:
        return _MergedState(self.optimizers)

    @state.setter
    def state(self, value) -> None:
        pass

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for o in self.optimizers:
            o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for o, sd in zip(self.optimizers, state_dict["optimizers"]):
            o.load_state_dict(sd)
