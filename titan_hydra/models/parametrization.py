"""Width / depth parametrizations (the ``parametrization`` group): sp, mup, completep.

A sweep of small models predicts a big run only if the best hyper-parameters do not drift with
size. Under the standard parametrization (``sp``, what every family's ``init_weights`` and the
optimizer do by themselves) they do. ``mup`` (Maximal Update Parametrization, Yang & Hu et al.,
"Tensor Programs V", 2022) rescales init, learning rates and two forward multipliers with the
width multiplier ``m = dim / base_width`` so that every layer's activations move by O(1) per
step at any width: the learning rate tuned at one width transfers. ``completep`` (Dey et al.
2025, alpha = 1) adds depth: each residual branch is scaled by ``base_depth / n_layers``.

What is infinite is read off the shapes, as the ``mup`` package does: the family's model is built
on the meta device at the run's args and at ``base_width`` (plus ``base`` for other fields),
and a dimension of a parameter that differs between the two grows with width. The roles
(``Geometry.role``) and what each gets, relative to the family's own (sp) init at the same width:

=========  ==========================================  ==========  ================
role       which parameters                             init std    Adam LR / decay
=========  ==========================================  ==========  ================
embedding  the token embedding tables                     x 1         x 1 / x 1
input      fan-in fixed, biases (norms, sinks, latent     x 1         x 1 / x 1
           up-projections of a fixed rank)
hidden     both fans grow (attention, FFN, experts)       / sqrt(m)   / m / x m
readout    fan-in grows, fan-out fixed (MoE routers)      / m         / m / x m
output     the LM head (logits then times 1 / m)          x sqrt(m)   x 1 / x 1
=========  ==========================================  ==========  ================

(the output row is the ``mup`` package's ``MuReadout``; the readout row is the same layer in
the multiplier-free form of TP5's Table 3, which needs no change to the routers' forward).
Weight decay moves opposite to the LR, so each step decays the same fraction as at the base
width (the ``mup`` package's ``MuAdam`` rule). Muon's rule differs (its update is a semi-
orthogonal matrix, not an entrywise one): ``train/width_scaling.py``. Attention scores are
scaled by ``attn_mult = sqrt(base_head_dim / head_dim)`` (1/head_dim rather than
1/sqrt(head_dim)); at ``base_width`` every multiplier is 1, so a mup model at its base width is
the sp model, and the sp learning rate tuned there is the one that transfers.

The multipliers follow the parameter's FQN, not the rank: FSDP / TP / EP shards and pipeline
stages look their own parameters up in one table of full shapes.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from titan_hydra.errors import ConfigError
from titan_hydra.models.common.decoder import MULTIPLIERS, Decoder

KINDS = ("sp", "mup", "completep")
OUTPUT = "output.weight"  # the Decoder's LM head


@dataclass(frozen=True)
class Geometry:
    """One parameter's full shape in the run's model and in the base model, and its role."""

    shape: tuple[int, ...]
    base: tuple[int, ...]
    role: str  # embedding | input | hidden | readout | output

    @property
    def fan_in_mult(self) -> float:
        """Width multiplier of the fan-in (the last dim of a [.., out, in] weight; 1 for vectors)."""
        return self.shape[-1] / self.base[-1] if len(self.shape) >= 2 else 1.0

    @property
    def fan_out_mult(self) -> float:
        return self.shape[-2] / self.base[-2] if len(self.shape) >= 2 else self.shape[0] / self.base[0]

    @property
    def init_mult(self) -> float:
        m = self.fan_in_mult
        return {"embedding": 1.0, "input": 1.0, "hidden": m**-0.5, "readout": 1.0 / m, "output": m**0.5}[self.role]


def role_of(name: str, shape: tuple[int, ...], base: tuple[int, ...], embeddings: set[str]) -> str:
    """The muP class of a parameter from its name and how its shape differs from the base one."""
    if name == OUTPUT:
        return "output"
    if name in embeddings:
        return "embedding"
    if len(shape) < 2 or shape[-1] == base[-1] or name.endswith("bias"):  # biases: stacked per expert too
        return "input"
    return "hidden" if shape[-2] != base[-2] else "readout"


@dataclass
class Parametrization:
    """The ``parametrization`` node: ``name`` (sp | mup | completep) and the base shape the
    multipliers are relative to: ``base_width`` replaces ``model.dim`` (mup, completep),
    ``base_depth`` ``model.n_layers`` (completep), ``base`` any other model field that a sweep
    scales with the width (added with Hydra's ``+``: ``+parametrization.base.ffn_hidden_dim=512``);
    sp reads none of them."""

    name: str = "sp"
    base_width: int | None = None
    base_depth: int | None = None
    base: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in KINDS:
            raise ConfigError(f"parametrization.name={self.name!r} is not one of {', '.join(KINDS)}")
        needed = {"mup": ("base_width",), "completep": ("base_width", "base_depth")}.get(self.name, ())
        for key, what in (("base_width", "model.dim"), ("base_depth", "model.n_layers")):
            value = getattr(self, key)
            if (value is None and key in needed) or (value is not None and value < 1):
                raise ConfigError(f"parametrization={self.name} needs parametrization.{key}=<the {what} its "
                                  f"hyper-parameters were tuned at> (>= 1; got {value})")

    @property
    def standard(self) -> bool:
        return self.name == "sp"

    def base_fields(self, family: Any, args: Any) -> dict[str, Any]:
        """The base model's args fields: the run's, with the base width and the ``base`` overrides
        (depth stays the run's: the base model must have the same parameter names)."""
        fields = family.args_fields(args)
        if self.base_width is not None:
            fields["dim"] = self.base_width
        for key, value in self.base.items():
            if key not in fields:
                raise ConfigError(f"parametrization.base.{key}={value}: the model has no field {key!r}; "
                                  "override only fields of the model node (e.g. head_dim, ffn_hidden_dim)")
            fields[key] = {**fields[key], **value} if isinstance(value, dict) else value
        return fields

    def model_multipliers(self, family: Any, args: Any) -> dict[str, float]:
        """The model fields this parametrization sets (sp: none, the model's own stay)."""
        if self.standard:
            return {}
        missing = [k for k in MULTIPLIERS if not hasattr(args, k)]
        if missing:
            raise ConfigError(f"parametrization={self.name}: model family {family.name!r} has no field {missing[0]} "
                              "(its args must inherit titan_hydra.models.common.decoder.Multipliers); use "
                              "parametrization=sp")
        if args.tie_word_embeddings:
            raise ConfigError(f"parametrization={self.name} needs separate input and output embeddings (they scale "
                              "differently with width); set model.tie_word_embeddings=false or parametrization=sp")
        scaled = _scaled_model(family, self._key(family, args))
        depth = int(args.n_layers) / self.base_depth if self.name == "completep" else 1.0
        return {"logit_mult": 1.0 / scaled.width_mult, "attn_mult": math.sqrt(scaled.head_dim_ratio),
                "residual_mult": 1.0 / depth}

    def geometry(self, family: Any, args: Any) -> dict[str, Geometry]:
        """{parameter FQN: Geometry} of the full model (empty under sp)."""
        return {} if self.standard else _scaled_model(family, self._key(family, args)).geometry

    def _key(self, family: Any, args: Any) -> tuple:
        return (family.name, json.dumps(family.args_fields(args), sort_keys=True),
                json.dumps(self.base_fields(family, args), sort_keys=True))


@dataclass(frozen=True)
class _Scaled:
    geometry: dict[str, Geometry]
    width_mult: float  # the LM head's fan-in multiplier: dim / base_width
    head_dim_ratio: float  # base head_dim / head_dim


def _meta_model(family: Any, fields: dict[str, Any]) -> nn.Module:
    if not family.builds_models():
        raise ConfigError(f"a width parametrization needs ModelFamily.build; family {family.name!r} has none: "
                          "use parametrization=sp")
    try:
        args = family.make_args(fields)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"parametrization's base model: {str(e).splitlines()[0]}") from None
    with torch.device("meta"):
        model = family.build(args)
    if not isinstance(model, Decoder):
        raise ConfigError(f"a width parametrization is defined for Decoder models; family {family.name!r} builds "
                          f"{type(model).__name__}: use parametrization=sp")
    return model


def _head_dim(model: nn.Module) -> int:
    return next(m.head_dim for m in model.modules() if hasattr(m, "score_mult") and hasattr(m, "head_dim"))


@lru_cache(maxsize=32)
def _scaled_model(family: Any, key: tuple) -> _Scaled:
    model = _meta_model(family, json.loads(key[1]))
    base = _meta_model(family, json.loads(key[2]))
    base_shapes = {n: tuple(p.shape) for n, p in base.named_parameters()}
    embeddings = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Embedding)}
    geometry = {}
    for name, p in model.named_parameters():
        shape, base_shape = tuple(p.shape), base_shapes[name]
        geometry[name] = Geometry(shape, base_shape, role_of(name, shape, base_shape, embeddings))
    return _Scaled(geometry, geometry[OUTPUT].fan_in_mult, _head_dim(base) / _head_dim(model))


def rescale_init(named_params: Iterable[tuple[str, torch.Tensor]], geometry: Mapping[str, Geometry]) -> None:
    """Multiply each freshly initialized parameter (FQNs of the full model, wrappers removed:
    a whole model, a pipeline stage or a rank's shards) by its role's init multiplier. The
    families' inits are zero-mean (truncated) normals, so this draws the same init at muP's std."""
    with torch.no_grad():
        for name, p in named_params:
            g = geometry.get(name)
            if g is not None and g.init_mult != 1.0:
                p.mul_(g.init_mult)


def with_multipliers(args: Any, values: dict[str, float]) -> Any:
    """``args`` with the multipliers ``values`` (a parametrization's ``model_multipliers``)."""
    return dataclasses.replace(args, **values) if values else args
