"""Gradient-norm clipping that is correct for every layout.

Gradients may be plain tensors (single, DDP) or DTensors (FSDP, TP, EP). torch's total-norm
helper takes a list of them and a DTensor result is materialized with ``full_tensor()``, but
one call cannot mix DTensors on different meshes: under expert parallel the routed experts
live on the expert mesh and everything else on the dense one. So the gradients are grouped by
mesh (plain tensors form a group of their own), each group's norm is taken and materialized,
and the groups combine as sum of p-th powers (max for the inf-norm). Groups are visited in an
order every rank agrees on, since materializing a norm is a collective. Under pipeline
parallelism each rank holds only its stages' gradients, so the p-th powers are summed over the
pipeline group before taking the root.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _by_mesh(params: list[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
    """Parameters grouped by their gradient's mesh: plain tensors first, then one group per
    DTensor mesh, ordered by the mesh's dim names and process groups (the same on every rank
    sharing it: groups are named in the order all ranks create them). Not by the mesh's rank
    tensor: reading it runs tensor ops, which the simulator's fake-tensor mode cannot answer."""
    plain = [p for p in params if not isinstance(p.grad, DTensor)]
    groups: dict = {}
    for p in params:
        if isinstance(p.grad, DTensor):
            groups.setdefault(p.grad.device_mesh, []).append(p)

    def key(mesh) -> tuple:
        return (tuple(mesh.mesh_dim_names or ()), tuple(mesh.get_group(i).group_name for i in range(mesh.ndim)))

    return ([plain] if plain else []) + [groups[m] for m in sorted(groups, key=key)]


def _norm(params: list[torch.nn.Parameter], norm_type: float) -> torch.Tensor:
    total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=norm_type, foreach=True)
    return total.full_tensor() if isinstance(total, DTensor) else total


def clip_grad_norm_(
    parameters: Iterable[torch.nn.Parameter],
    max_norm: float,
    norm_type: float = 2.0,
    pp_group: "dist.ProcessGroup | None" = None,
) -> torch.Tensor:
    """Clip in place (when max_norm > 0) and return the global gradient norm."""
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.tensor(0.0)
    groups = _by_mesh(params)
    norms = [_norm(group, norm_type) for group in groups]
    if len(norms) == 1:
        total = norms[0]
    elif math.isinf(norm_type):
        total = torch.stack(norms).max()
    else:
        total = torch.stack([n.float() ** norm_type for n in norms]).sum() ** (1.0 / norm_type)
    if pp_group is not None:
        if math.isinf(norm_type):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_group)
        else:
            total = total**norm_type
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_group)
            total = total ** (1.0 / norm_type)
    if max_norm > 0:
        for group in groups:  # one foreach call per mesh: DTensor ops do not mix meshes
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total
