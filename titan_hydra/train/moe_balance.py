"""MoE load balancing, once per optimizer step: the expert-bias update and the load metrics.

A training hook rather than model code because it sums every MoE layer's token counts over the
data x context parallel ranks (one all-reduce), so that every rank moves its biases identically;
the model only counts (``MoE.tokens_per_expert``) and chooses with the bias (``MoE.expert_bias``).
A layer is any module with a ``tokens_per_expert`` buffer: the native ``MoE``, and transformers'
MoE blocks under ``model=hf`` (``models/hf/router.py``; metrics only, they have no bias).
"""

from __future__ import annotations

import functools
import re
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from titan_hydra.models.common.moe import MoE


def moe_balance_hooks(model_parts: list[nn.Module], dims: Any) -> list[Callable[[], dict[str, float]]]:
    """The trainer's step hook for models with MoE layers (none for dense models, or a pipeline
    stage without MoE layers), with token counts summed over the data x context parallel ranks."""
    if not counted_layers(model_parts):
        return []
    mesh = dims.submesh("dp_cp") if dims is not None else None
    group = mesh.get_group() if mesh is not None else None
    return [functools.partial(balance_step, model_parts, group)]


_LAYER_RE = re.compile(r"(?:^|\.)(mtp_)?layers\.(\d+)\.")


def _layer_label(name: str) -> str:
    """``layer<i>`` for ``layers.<i>``, ``mtp_layer<k>`` for a multi-token prediction depth."""
    m = _LAYER_RE.search(name + ".")
    return f"{m.group(1) or ''}layer{m.group(2)}" if m else (name.replace(".", "_") or "root")


def counted_layers(model_parts: Iterable[nn.Module]) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module that counts its tokens per expert."""
    return [(name, m) for part in model_parts for name, m in part.named_modules()
            if isinstance(getattr(m, "tokens_per_expert", None), torch.Tensor)]


def _process_group(group: Any):
    if group is None:
        return None
    return group.get_group() if hasattr(group, "get_group") else group


@torch.no_grad()
def balance_step(model_parts: Iterable[nn.Module], group: Any = None) -> dict[str, float]:
    """Once per optimizer step: all-reduce each MoE layer's token counts over ``group`` (the
    data x context parallel ranks; a ProcessGroup, a 1-D DeviceMesh, or None in one process),
    move the expert biases (if load_balance_coeff > 0: bias += coeff * sign(mean - count), then
    recentred to mean 0), reset the counts and return load metrics:

    * ``moe/max_over_mean``: the worst layer's max/mean tokens per expert (1.0 = perfectly even),
    * ``moe/idle_frac``: fraction of (layer, expert) pairs that got no token this step,
    * ``moe/layer<i>/max_over_mean`` for each layer.

    Every rank gets the same sums, so biases stay identical on every rank.
    """
    layers = counted_layers(model_parts)
    if not layers:
        return {}
    counts = torch.cat([m.tokens_per_expert.float() for _, m in layers])
    pg = _process_group(group)
    if pg is not None and dist.is_initialized() and dist.get_world_size(pg) > 1:
        dist.all_reduce(counts, group=pg)
    ratios, idle, total = [], torch.zeros((), device=counts.device), 0
    start = 0
    for _, m in layers:
        n = m.tokens_per_expert.numel()
        c = counts[start:start + n]
        start += n
        mean = c.mean()
        ratios.append(torch.where(mean > 0, c.max() / mean.clamp_min(1e-20), torch.zeros_like(mean)))
        idle = idle + (c == 0).sum()
        total += c.numel()
        if isinstance(m, MoE) and m.args.load_balance_coeff > 0:
            m.expert_bias.add_(m.args.load_balance_coeff * torch.sign(mean - c))
            m.expert_bias.sub_(m.expert_bias.mean())
        m.tokens_per_expert.zero_()
    if not bool(counts.sum() > 0):
        return {}
    values = torch.stack([*ratios, idle / total]).tolist()
    metrics = {f"moe/{_layer_label(name)}/max_over_mean": v for (name, _), v in zip(layers, values[:-1])}
    return {"moe/max_over_mean": max(values[:-1]), "moe/idle_frac": values[-1], **metrics}
