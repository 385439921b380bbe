"""ParallelDims: the `parallelism` group's object. Degrees -> validated layout -> DeviceMesh.

Mesh dimension order (outer to inner): pp, dp_replicate, dp_shard, cp, tp. TP is innermost
so that it stays inside a node on GPU clusters; flattened views ("dp", "dp_shard_cp",
"dp_cp") are what FSDP, data loading and loss averaging need.

Expert parallel (``ep``) adds no ranks: it borrows them from dp_shard x cp. Routed experts live
on a second mesh over the same ranks, [pp, dp_replicate, efsdp, ep] with efsdp = dp_shard*cp/ep:
the ep ranks of one group split the experts between them, and the efsdp ranks holding the same
experts shard them FSDP-style. Both meshes come from one root (the expert one is an unflatten
of the dense dp_shard x cp dims), which is what FSDP needs to combine efsdp with the experts'
ep placement into one DTensor layout.
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
RESHARD_POLICIES = ("default", "always", "never")
AUTO_VERIFY = ("none", "simulate")
CP_ROTATE_METHODS = ("allgather", "alltoall")


@dataclass
class ParallelDims:
    """Degrees of every parallel dimension; world size = dp_replicate*dp_shard*cp*tp*pp
    (``ep`` adds no ranks: it must divide dp_shard*cp). Its fields and defaults are the
    ``parallelism`` group's schema (titan_hydra.groups); the recipe passes ``world_size``.

    ``dp_shard=-1`` takes whatever the other degrees leave of the world size.
    """

    world_size: int = 1
    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    # FSDP / DDP
    fsdp_reshard_after_forward: str = "default"  # one of RESHARD_POLICIES
    fsdp_cpu_offload: bool = False
    # tensor parallel
    tp_sequence_parallel: bool = True
    tp_loss_parallel: bool = True
    tp_async: bool = False
    # pipeline parallel
    pp_schedule: str = "1F1B"  # one of PP_SCHEDULES
    pp_microbatches: int | None = None
    pp_layers_per_stage: int | None = None
    pp_split_points: list[str] = field(default_factory=list)
    # context parallel
    cp_rotate_method: str = "allgather"  # one of CP_ROTATE_METHODS
    # expert parallel (MoE models): routed experts split over ep ranks borrowed from dp_shard x cp;
    # -1 = all of them
    ep: int = 1
    # torchft replica groups (the ``fault_tolerance`` group): this mesh is one of ``replica_groups``
    # identical groups that average gradients through torchft; all of them together read
    # ``data_degree`` batch slices per step. 1 without fault tolerance.
    replica_groups: int = 1
    replica_group: int = 0
    # parallelism=auto only: "simulate" checks the planner's best candidates by simulating them
    # (dry_run=simulate's simulator), the fastest first, at most auto_verify_max of them
    auto_verify: str = "none"  # one of AUTO_VERIFY
    auto_verify_max: int = 3

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
        self._check_ep()
        if self.fsdp_reshard_after_forward not in RESHARD_POLICIES:
            raise ConfigError(
                f"parallelism.fsdp_reshard_after_forward={self.fsdp_reshard_after_forward!r} is not one of "
                f"{', '.join(RESHARD_POLICIES)}"
            )
        if self.pp_schedule not in PP_SCHEDULES:
            raise ConfigError(f"parallelism.pp_schedule={self.pp_schedule!r} is not one of {', '.join(PP_SCHEDULES)}")
        if self.auto_verify not in AUTO_VERIFY:
            raise ConfigError(f"parallelism.auto_verify={self.auto_verify!r} is not one of {', '.join(AUTO_VERIFY)}")
        if self.auto_verify_max < 1:
            raise ConfigError(f"parallelism.auto_verify_max={self.auto_verify_max} must be >= 1")
        if self.cp_rotate_method not in CP_ROTATE_METHODS:
            raise ConfigError(
                f"parallelism.cp_rotate_method={self.cp_rotate_method!r} is not one of {', '.join(CP_ROTATE_METHODS)}"
            )

    def _check_ep(self) -> None:
        if self.ep == -1:
            self.ep = self.dp_shard * self.cp
        if self.ep < 1:
            raise ConfigError(f"parallelism.ep={self.ep} must be >= 1 or -1 (= all dp_shard*cp ranks)")
        if (self.dp_shard * self.cp) % self.ep:
            raise ConfigError(
                f"parallelism.ep={self.ep} must divide dp_shard*cp={self.dp_shard * self.cp} (expert-parallel "
                "ranks are borrowed from them); change parallelism.ep or the data-parallel degrees"
            )
        if self.ep > 1 and self.tp > 1:
            raise ConfigError(
                f"parallelism.ep={self.ep} with parallelism.tp={self.tp} is not supported; "
                "set parallelism.tp=1 or parallelism.ep=1"
            )

    # --- what is on ---------------------------------------------------------------
    @property
    def dp_degree(self) -> int:
        """Data-parallel degree: how many different batches one step consumes."""
        return self.dp_replicate * self.dp_shard

    @property
    def data_degree(self) -> int:
        """Batch slices one step consumes across every replica group (= dp_degree without torchft)."""
        return self.dp_degree * self.replica_groups

    def batch_plan(self, local_batch_size: int, global_batch_size: int) -> tuple[int, int]:
        """(global batch, gradient-accumulation steps); ``global_batch_size <= 0`` = no accumulation.

        The one place this is computed (trainer, pipeline loss scaling, estimator, validation).
        Raises ConfigError when the global batch is not a whole number of local batches.
        """
        per_step = local_batch_size * self.data_degree
        if global_batch_size <= 0:
            return per_step, 1
        if global_batch_size % per_step:
            raise ConfigError(
                f"training.global_batch_size={global_batch_size} is not a multiple of local_batch_size "
                f"{local_batch_size} x data-parallel degree {self.data_degree}; set it to a multiple of {per_step} "
                "or -1 (one local batch per rank)"
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
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def efsdp(self) -> int:
        """Expert-FSDP degree: ranks that hold the same experts and shard them between them."""
        return self.dp_shard * self.cp // self.ep

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
        # The flattened meshes are kept here: slicing a flattened dim off the root mesh is deprecated
        # (torch 2.13 warns on every rank of an HSDP run).
        self._flat = {flat_name: mesh[tuple(parts)]._flatten(mesh_dim_name=flat_name)
                      for flat_name, parts in flat.items() if len(parts) > 1}
        self._mesh = mesh
        if self.ep_enabled:
            self._expert_mesh = self._build_expert_mesh(mesh)
        return mesh

    def _build_expert_mesh(self, mesh):
        """[pp?, dp_replicate?, efsdp, ep] over the same ranks: dp_shard x cp unflattened into
        (efsdp, ep), so an ep group is ``ep`` consecutive ranks of the dp_shard x cp order.
        efsdp is kept even when it is 1 (FSDP of the experts needs a mesh to run on)."""
        import warnings

        names = mesh.mesh_dim_names
        outer = [n for n in ("pp", "dp_replicate") if n in names]
        shard_dims = [n for n in ("dp_shard", "cp") if n in names]
        shard = "dp_shard_cp" if len(shard_dims) == 2 else shard_dims[0]
        with warnings.catch_warnings():
            # torch 2.13 announces that slicing a flattened dim off the root mesh will be deprecated.
            warnings.filterwarnings("ignore", message="Slicing a flattened dim")
            base = mesh[(*outer, shard)] if outer else mesh[shard]
        expert = base._unflatten(len(outer), (self.efsdp, self.ep), ("efsdp", "ep"))
        # Lets DTensor reduce over both dims in one collective (gradient norms of the experts).
        expert["efsdp", "ep"]._flatten(mesh_dim_name="efsdp_ep")
        return expert

    def expert_mesh(self, *names: str):
        """The expert mesh, or its sub-mesh over ``names`` (present ones only); None without EP."""
        mesh = getattr(self, "_expert_mesh", None)
        if mesh is None or not names:
            return mesh
        present = tuple(n for n in names if n in mesh.mesh_dim_names)
        return mesh[present] if len(present) > 1 else mesh[present[0]]

    def submesh(self, name: str):
        """The named (possibly flattened) sub-mesh, or None when that dimension is trivial."""
        if name in ("ep", "efsdp"):
            return self.expert_mesh(name)
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
        return self._flat[name]

    def dp_rank(self) -> int:
        """This rank's index among data-parallel replicas (which slice of the batch it reads)."""
        dp = self.submesh("dp")
        return 0 if dp is None else dp.get_local_rank()

    def data_rank(self) -> int:
        """Which of the ``data_degree`` batch slices this rank reads (its replica group's block first)."""
        return self.replica_group * self.dp_degree + self.dp_rank()

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
