"""The collectives one simulated rank issues, per mesh dimension: op, count, bytes.

A dispatch mode sees both kinds of collective the layout uses: c10d's in-place ops (FSDP2's
all-gather and reduce-scatter, the pipeline's send/recv, all-to-all of expert parallelism) and
the functional ones DTensor issues (TP's all-reduce / all-gather / reduce-scatter, the gradient
norm's all-reduce). Each names its process group; the group is mapped back to the mesh
dimension it belongs to (``dp_shard``, ``tp``, ``efsdp`` ...; a flattened one by its flat name).

Bytes are the data each rank moves through the op: the gathered output of an all-gather, the
input of a reduce-scatter, all-reduce, all-to-all and of a send/recv (the wire traffic of a ring
is (n-1)/n of it).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

# op name -> (reported op, index of the argument whose size is the op's bytes, index of the group)
C10D = {
    "_allgather_base_": ("all_gather", 0, 2),
    "allgather_": ("all_gather", 0, 2),
    "allgather_into_tensor_coalesced_": ("all_gather", 0, 2),
    "_reduce_scatter_base_": ("reduce_scatter", 1, 2),
    "reduce_scatter_": ("reduce_scatter", 1, 2),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, 2),
    "allreduce_": ("all_reduce", 0, 1),
    "allreduce_coalesced_": ("all_reduce", 0, 1),
    "alltoall_base_": ("all_to_all", 1, 2),
    "alltoall_": ("all_to_all", 1, 2),
    "broadcast_": ("broadcast", 0, 1),
    "send": ("send", 0, 1),
    "recv_": ("recv", 0, 1),
}
FUNCTIONAL = {  # _c10d_functional: the group name is the last positional argument
    "all_gather_into_tensor": ("all_gather", "out"),
    "all_gather_into_tensor_coalesced": ("all_gather", "out"),
    "reduce_scatter_tensor": ("reduce_scatter", "in"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "in"),
    "all_reduce": ("all_reduce", "in"),
    "all_reduce_coalesced": ("all_reduce", "in"),
    "all_to_all_single": ("all_to_all", "in"),
    "broadcast": ("broadcast", "in"),
}


def nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(nbytes(t) for t in x)
    return 0


def group_names(dims) -> dict[str, str]:
    """Process-group name -> the mesh dimension it serves (plain, flattened and expert dims)."""
    names: dict[str, str] = {}
    meshes = [getattr(dims, "_mesh", None), *getattr(dims, "_flat", {}).values(),
              getattr(dims, "_expert_mesh", None)]
    for mesh in meshes:
        if mesh is None:
            continue
        for dim in mesh.mesh_dim_names or ():
            names.setdefault(mesh.get_group(dim).group_name, dim)
    names.setdefault(dist.group.WORLD.group_name, "world")
    return names


@dataclass(frozen=True)
class Collective:
    mesh_dim: str
    op: str
    count: int
    bytes: int


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives issued under it, by (mesh dim, op)."""

    def __init__(self, dims) -> None:
        super().__init__()
        self.names = group_names(dims)
        self.counts: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])

    def _dim(self, group) -> str:
        if isinstance(group, str):
            name = group
        elif isinstance(group, torch.ScriptObject):  # c10d ops carry the group boxed
            name = dist.ProcessGroup.unbox(group).group_name
        else:
            name = group.group_name
        return self.names.get(name, name)

    def add(self, dim: str, op: str, n: int) -> None:
        entry = self.counts[(dim, op)]
        entry[0] += 1
        entry[1] += n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor's dispatch first: the collectives inside its ops come back here
        ns, name = func.namespace, func._opname  # noqa: SLF001
        if ns == "c10d" and name in C10D:
            op, data_arg, group_arg = C10D[name]
            self.add(self._dim(args[group_arg]), op, nbytes(args[data_arg]))
        out = func(*args, **(kwargs or {}))
        if ns == "_c10d_functional" and name in FUNCTIONAL:
            op, which = FUNCTIONAL[name]
            self.add(self._dim(args[-1]), op, nbytes(out if which == "out" else args[0]))
        return out

    def per_step(self, steps: int) -> list[Collective]:
        return [Collective(dim, op, c // steps, b // steps) for (dim, op), (c, b) in sorted(self.counts.items())]
