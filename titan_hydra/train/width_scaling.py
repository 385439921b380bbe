"""A parameter's learning-rate and weight-decay multipliers under muP, per optimizer class.

The roles and the init are ``models/parametrization.py``'s; the LR rule depends on what the
optimizer's update looks like, so it lives here, beside the optimizers:

* Adam / AdamW normalize the update entrywise (every entry ~lr), so a matrix whose fan-in grows m
  times moves its output m times more: hidden and readout weights take lr / m, input-like ones
  and the LM head (whose logits are already times 1/m) lr (TP5 Table 3; the ``mup`` package's
  ``MuAdam``).
* Muon's update is semi-orthogonal (spectral norm 1) times its shape adjustment
  (``train/muon.adjusted_lr``). muP asks for a step of spectral norm ~ sqrt(fan_out / fan_in)
  (Yang, Simon & Bernstein 2023, "A spectral condition for feature learning"), so the multiplier
  is that ratio's square root over how much the adjustment already grew between the base shape and
  this one: 1 for hidden matrices under ``adjust_lr_fn: original``, 1/sqrt(m) under
  ``match_rms_adamw`` (whose 0.2 sqrt(max(rows, cols)) grows with width). The head and embedding
  have no Muon rule here (their roles are defined by Adam-like updates): they stay on AdamW.

Weight decay takes the inverse multiplier, so ``lr * weight_decay``, the fraction decayed per
step, is the base width's (``MuAdam``'s rule, and what AdamW's and Muon's decoupled decay need).
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

import torch

from titan_hydra.errors import ConfigError
from titan_hydra.models.parametrization import Geometry
from titan_hydra.train.muon import Muon, adjusted_lr

# the roles whose fan-in grows with width: Adam's entrywise step must shrink with it
ADAM_SCALED = ("hidden", "readout")


def muon_lr_mult(g: Geometry, adjust_lr_fn: str | None) -> float:
    """Muon's muP multiplier of a 2-D parameter: the spectral target over the shape adjustment's growth."""
    grown = adjusted_lr(1.0, adjust_lr_fn, torch.Size(g.shape)) / adjusted_lr(1.0, adjust_lr_fn, torch.Size(g.base))
    return (g.fan_out_mult / g.fan_in_mult) ** 0.5 / grown


def multipliers(cls: type, settings: Mapping[str, Any], g: Geometry, name: str) -> tuple[float, float]:
    """(LR multiplier, weight-decay multiplier) of parameter ``name`` under optimizer ``cls``."""
    if issubclass(cls, Muon):
        if g.role in ("output", "embedding"):
            raise ConfigError(f"parametrization: {name} ({g.role} weights) has no Muon width rule; leave it to "
                              "AdamW (optimizer.param_groups: match only the blocks' matrices, e.g. 'layers.*')")
        lr = muon_lr_mult(g, settings.get("adjust_lr_fn"))
    elif issubclass(cls, (torch.optim.Adam, torch.optim.AdamW)):
        lr = 1.0 / g.fan_in_mult if g.role in ADAM_SCALED else 1.0
    else:
        raise ConfigError(f"parametrization has width rules for Adam, AdamW and Muon; {name} is trained by "
                          f"{cls.__name__}: use one of those or parametrization=sp")
    return lr, 1.0 / lr


def base_lr(cls: type, settings: Mapping[str, Any]) -> float:
    """The group's LR before its multiplier: its own setting, else the class's default."""
    if "lr" in settings:
        return float(settings["lr"])
    return float(inspect.signature(cls.__init__).parameters["lr"].default)


def split_group(group: dict[str, Any], named: list[tuple[str, torch.Tensor]], cls: type,
                settings: Mapping[str, Any], geometry: Mapping[str, Geometry]) -> list[dict[str, Any]]:
    """``group`` (a param-group dict whose parameters are ``named``) as one group per distinct
    (LR, decay) multiplier pair, the unscaled one first (the run logs the first group's LR as
    ``lr``). Without geometry (sp) the group itself: nothing changes."""
    if not geometry:
        return [{**group, "params": [p for _, p in named]}]
    buckets: dict[tuple[float, float], list[torch.Tensor]] = {}
    for name, p in named:
        g = geometry.get(name)
        buckets.setdefault(multipliers(cls, settings, g, name) if g else (1.0, 1.0), []).append(p)
    out = []
    for (lr_mult, wd_mult), params in sorted(buckets.items(), key=lambda kv: kv[0] != (1.0, 1.0)):
        scaled = {**group, "params": params}
        if (lr_mult, wd_mult) != (1.0, 1.0):
            scaled["lr"] = base_lr(cls, settings) * lr_mult
            if settings.get("weight_decay") is not None:
                scaled["weight_decay"] = float(settings["weight_decay"]) * wd_mult
            scaled["group_name"] = f"{group.get('group_name', 'default')}_x{lr_mult:.4g}"
        out.append(scaled)
    return out
