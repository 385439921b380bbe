"""Distributed checkpointing (torch.distributed.checkpoint): save, resume, reshard, export.

``manager.CheckpointManager`` is what the recipe uses (the ``checkpoint`` group instantiates it
as a partial; the recipe adds the model, optimizer, loader and train state); ``storage`` holds the on-disk layout
(step dirs, completion markers) and the code that reads checkpoints without trusting them.
"""

from __future__ import annotations

from titan_hydra.checkpoint.manager import CheckpointManager, PartsView
from titan_hydra.checkpoint.storage import CheckpointError, latest_complete, list_steps, read_marker

__all__ = ["CheckpointManager", "CheckpointError", "PartsView", "latest_complete", "list_steps", "read_marker"]
