"""Weights cast to the compute dtype once per optimizer step instead of once per use.

Under autocast with fp32 parameters, MoE experts cast their stacked weights (most of the
model's parameters) to bf16 explicitly (``torch._grouped_mm`` has no autocast rule): on every
forward, again in each activation-checkpoint recompute, and once per microbatch: on a small MoE
on CPU a visible share of the step (docs/bench/notes_models.md). A ``WeightCastCache``
keeps the cast copy until the weight changes: until the next optimizer step (every
``torch.optim.Optimizer`` step clears every cache, through torch's global step hook: fused
optimizers update in place without bumping a tensor's version) or until the weight is written in
place otherwise (its version counter moves). Gradients flow to the fp32 weight as through
``.to(dtype)``. The copy lives from the first forward to the next optimizer step; while
torch.compile traces, weights are cast inline.
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

_CACHES: weakref.WeakSet[WeightCastCache] = weakref.WeakSet()


class _CastFromCache(torch.autograd.Function):
    """``weight`` as the copy ``cached`` (forward), its gradient cast back (backward)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
        ctx.weight_dtype = weight.dtype
        return cached.view_as(cached)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.weight_dtype), None


class WeightCastCache:
    """Per-module copies keyed by the caller (e.g. the weight's index in the module)."""

    def __init__(self):
        self._copies: dict[object, tuple[int, torch.dtype, torch.Tensor]] = {}
        _CACHES.add(self)

    def clear(self) -> None:
        self._copies.clear()

    def cast(self, key: object, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``weight.to(dtype)``, from the copy made earlier in this step when there is one."""
        if weight.dtype == dtype or torch.compiler.is_compiling():
            return weight.to(dtype)
        hit = self._copies.get(key)
        if hit is None or hit[0] != weight._version or hit[1] != dtype or hit[2].shape != weight.shape:
            with torch.no_grad():
                hit = (weight._version, dtype, weight.detach().to(dtype))
            self._copies[key] = hit
        if not (weight.requires_grad and torch.is_grad_enabled()):
            return hit[2]
        return _CastFromCache.apply(weight, hit[2])


def clear_all(*_args) -> None:
    """Drop every cached copy (before any optimizer step; also frees their memory for it)."""
    for cache in list(_CACHES):
        cache.clear()


register_optimizer_step_pre_hook(clear_all)
