"""One rank of a world of any size, inside this process: torch's fake process group.

Every collective of the fake backend returns at once without moving data, so a rank of a
512-rank job builds its DeviceMesh, shards its model and issues its collectives alone. The mesh
and the layout are built outside fake-tensor mode (DeviceMesh's rank bookkeeping runs real ops:
under FakeTensorMode it hits a data-dependent ``nonzero``); only the model's storage and what the
steps compute are fake.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._redistribute import _gen_transform_infos
from torch.testing._internal.distributed.fake_pg import FakeStore


@contextlib.contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """This process as ``rank`` of ``world_size`` under the fake backend, for the block's duration."""
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized here: simulate in a process of its own")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        forget_meshes()


def forget_meshes() -> None:
    """Drop DTensor's sharding-propagation caches: they are keyed by meshes that compare equal
    across worlds (same shape and names), so the next simulated rank would get this world's
    meshes back and address process groups that no longer exist."""
    propagator = DTensor._op_dispatcher.sharding_propagator  # noqa: SLF001
    propagator.propagate_op_sharding.cache.cache_clear()
    type(propagator)._propagate_tensor_meta_cached.cache_clear()  # noqa: SLF001
    _gen_transform_infos.cache_clear()
