"""Distributed checkpointing (torch.distributed.checkpoint): save, resume, reshard, export.

``manager.CheckpointManager`` is what the recipe uses (the ``checkpoint`` group instantiates it
as a partial; the recipe adds the model, optimizer, loader and train state); it composes the
modules that each do one job: ``state`` (what a checkpoint holds), ``save``, ``resume`` (what a
run starts from), ``load`` (verify, then apply), ``hf_import``, ``rng``. ``storage`` holds the
on-disk layout (step dirs, completion markers) and the code that reads checkpoints without
trusting them.

This package sits below training and launching: it imports only itself, titan_hydra.models,
.errors, .hardware and .config (and torch, numpy, the standard library).
"""

from __future__ import annotations

from titan_hydra.checkpoint.manager import CheckpointManager
from titan_hydra.checkpoint.state import PartsView
from titan_hydra.checkpoint.storage import CheckpointError, latest_complete, list_steps, read_marker

__all__ = ["CheckpointManager", "CheckpointError", "PartsView", "latest_complete", "list_steps", "read_marker"]
