"""Distributed checkpointing (torch.distributed.checkpoint): save, resume, reshard, export.

``manager.CheckpointManager`` is what the recipe uses; ``storage`` holds the on-disk layout
(step dirs, completion markers) and the code that reads checkpoints without trusting them.
"""

from __future__ import annotations

from titan_hydra.checkpoint.manager import CheckpointManager, PartsView
from titan_hydra.checkpoint.storage import CheckpointError, latest_complete, list_steps, read_marker

__all__ = ["CheckpointManager", "CheckpointError", "PartsView", "build_checkpointer", "latest_complete",
           "list_steps", "read_marker"]


def build_checkpointer(cfg, run_dir: str, trainer, *, family, model_args, flavor: str, model_parts, optimizer,
                       lr_scheduler, train_loader, dims, rank: int, world_size: int) -> CheckpointManager | None:
    """The run's checkpoint manager, or None when checkpointing and initial loads are all off."""
    c = cfg.checkpoint
    if not (c.enable or c.initial_load_path or getattr(c, "create_seed_checkpoint", False)):
        return None
    return CheckpointManager(
        c, run_dir, model_parts=model_parts, optimizer=optimizer, lr_scheduler=lr_scheduler,
        train_loader=train_loader, trainer=trainer, dims=dims, family=family, model_args=model_args,
        flavor=flavor, rank=rank, world_size=world_size,
    )
