"""ParallelDims: the `parallelism` group's object. Degrees -> validated layout -> DeviceMesh.

Mesh dimension order (outer to inner): pp, dp_replicate, dp_shard, cp, tp. TP is innermost
so that it stays inside a node on GPU clusters; flattened views ("dp", "dp_shard_cp",
"dp_cp") are what FSDP, data loading and loss averaging need.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from titan_hydra.errors import ConfigError

PP_SCHEDULES = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)


@dataclass
class ParallelDims:
    world_size: int = 1
    name: str = "single"
    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    fsdp_reshard_after_forward: str = "default"
    fsdp_cpu_offload: bool = False
    tp_sequence_parallel: bool = True
    tp_loss_parallel: bool = True
    tp_async: bool = False
    pp_schedule: str = "1F1B"
    pp_microbatches: int | None = None
    pp_layers_per_stage: int | None = None
    pp_split_points: list[str] = field(default_factory=list)
    cp_rotate_method: str = "allgather"

    def __post_init__(self) -> None:
        for key in ("dp_replicate", "tp", "pp", "cp"):
            if getattr(self, key) < 1:
                raise ConfigError(f"parallelism.{key}={getattr(self, key)} must be >= 1")
        if self.dp_shard == 0 or self.dp_shard < -1:
            raise ConfigError(f"parallelism.dp_shard={self.dp_shard} must be >= 1 or -1 (= the rest)")
        others = self.dp_replicate * self.tp * self.pp * self.cp
        if self.dp_shard == -1:
            if self.world_size % others != 0:
                raise ConfigError(
                    f"world size {self.world_size} is not divisible by dp_replicate*tp*pp*cp={others}; "
                    "change cluster.nproc_per_node or the parallel degrees"
                )
            self.dp_shard = self.world_size // others
        product = others * self.dp_shard
        if product != self.world_size:
            raise ConfigError(
                f"parallel degrees dp_replicate*dp_shard*tp*pp*cp={product} != world size {self.world_size} "
                f"(cluster.nnodes*cluster.nproc_per_node); set parallelism.dp_shard=-1 or fix the degrees"
            )
        if self.fsdp_reshard_after_forward not in ("default", "always", "never"):
            raise ConfigError(
                f"parallelism.fsdp_reshard_after_forward={self.fsdp_reshard_after_forward!r}; "
                "use default, always or never"
            )
        if self.pp_schedule not in PP_SCHEDULES:
            raise ConfigError(f"parallelism.pp_schedule={self.pp_schedule!r} unknown; use one of {PP_SCHEDULES}")
        if self.cp_rotate_method not in ("allgather", "alltoall"):
            raise ConfigError(
                f"parallelism.cp_rotate_method={self.cp_rotate_method!r}; use allgather or alltoall"
            )

    # --- what is on ---------------------------------------------------------------
    @property
    def dp_degree(self) -> int:
        """Data-parallel degree: how many different batches one step consumes."""
        return self.dp_replicate * self.dp_shard

    def batch_plan(self, local_batch_size: int, global_batch_size: int) -> tuple[int, int]:
        """(global batch, gradient-accumulation steps); ``global_batch_size <= 0`` = no accumulation.

        The one place this is computed (trainer, pipeline loss scaling, estimator, validation).
        Raises ConfigError when the global batch is not a whole number of local batches.
        """
        per_step = local_batch_size * self.dp_degree
        if global_batch_size <= 0:
            return per_step, 1
        if global_batch_size % per_step:
            raise ConfigError(
                f"training.global_batch_size={global_batch_size} is not a multiple of local_batch_size "
                f"{local_batch_size} x data-parallel degree {self.dp_degree}"
            )
        return global_batch_size, global_batch_size // per_step

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1 or self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def loss_parallel_enabled(self) -> bool:
        return self.tp_enabled and self.tp_loss_parallel

    # --- mesh ---------------------------------------------------------------------
    def build_mesh(self, device_type: str) -> "torch.distributed.device_mesh.DeviceMesh | None":
        """World DeviceMesh with named dims for every degree > 1 (None for one process)."""
        if self.world_size == 1:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        dims = [
            (n, d)
            for n, d in (
                ("pp", self.pp),
                ("dp_replicate", self.dp_replicate),
                ("dp_shard", self.dp_shard),
                ("cp", self.cp),
                ("tp", self.tp),
            )
            if d > 1
        ]
        names = tuple(n for n, _ in dims)
        mesh = init_device_mesh(device_type, tuple(d for _, d in dims), mesh_dim_names=names)
        flat = {
            "dp": [n for n in ("dp_replicate", "dp_shard") if n in names],
            "dp_shard_cp": [n for n in ("dp_shard", "cp") if n in names],
            "dp_cp": [n for n in ("dp_replicate", "dp_shard", "cp") if n in names],
        }
        for flat_name, parts in flat.items():
            if len(parts) > 1:
                mesh[tuple(parts)]._flatten(mesh_dim_name=flat_name)
        self._mesh = mesh
        return mesh

    def submesh(self, name: str):
        """The named (possibly flattened) sub-mesh, or None when that dimension is trivial."""
        mesh = getattr(self, "_mesh", None)
        if mesh is None:
            return None
        flat_parts = {
            "dp": ("dp_replicate", "dp_shard"),
            "dp_shard_cp": ("dp_shard", "cp"),
            "dp_cp": ("dp_replicate", "dp_shard", "cp"),
        }
        present = [n for n in flat_parts.get(name, (name,)) if n in mesh.mesh_dim_names]
        if not present:
            return None
        if len(present) == 1:
            return mesh[present[0]]
        return mesh[name]

    def dp_rank(self) -> int:
        """This rank's index among data-parallel replicas (which slice of the batch it reads)."""
        dp = self.submesh("dp")
        return 0 if dp is None else dp.get_local_rank()

    def global_mean(self, value: torch.Tensor) -> float:
        """Mean of a per-rank scalar over the data-parallel (+ context-parallel) ranks."""
        mesh = self.submesh("dp_cp")
        value = value.detach().float()
        if mesh is not None:
            value = value.clone()
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=mesh.get_group())
            value = value / mesh.size()
        return float(value.item())

    # --- pipeline helpers the trainer calls (no-ops without PP) ------------------------
    def pp_group(self):
        mesh = self.submesh("pp")
        return None if mesh is None else mesh.get_group()

    def broadcast_pp_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Give every pipeline rank the last stage's loss (only the last stage computes it).

        A sum where the other ranks contribute 0: the last stage is not always on the last pp
        rank (V-shaped schedules put it on pp rank 0).
        """
        mesh = self.submesh("pp")
        if mesh is None:
            return loss
        loss = loss.detach().float().clone()
        dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=mesh.get_group())
        return loss
