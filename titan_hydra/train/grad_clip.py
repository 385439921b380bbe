"""Gradient-norm clipping that is correct for every layout.

Gradients may be plain tensors (single, DDP) or DTensors (FSDP, TP); torch's total-norm helper
handles both and a DTensor result is materialized with ``full_tensor()``. Under pipeline
parallelism each rank holds only its stages' gradients, so the p-th powers are summed over the
pipeline group before taking the root.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def clip_grad_norm_(
    parameters: Iterable[torch.nn.Parameter],
    max_norm: float,
    norm_type: float = 2.0,
    pp_group: "dist.ProcessGroup | None" = None,
) -> torch.Tensor:
    """Clip in place (when max_norm > 0) and return the global gradient norm."""
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    if not grads:
        return torch.tensor(0.0)
    total = torch.nn.utils.get_total_norm(grads, norm_type=norm_type, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if pp_group is not None:
        if math.isinf(norm_type):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_group)
        else:
            total = total**norm_type
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_group)
            total = total ** (1.0 / norm_type)
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total
