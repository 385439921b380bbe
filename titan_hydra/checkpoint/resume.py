"""Choosing what a run starts from: its own newest complete checkpoint, a requested step, an
``initial_load_path`` (a step dir, a checkpoint folder or an HF directory), or a seed checkpoint.

Only complete checkpoints (with a completion marker) are candidates: a step dir without one is a
save that was interrupted, and it is named in the log and skipped rather than loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from titan_hydra.checkpoint.save import Saver
from titan_hydra.checkpoint.storage import STEP_RE, CheckpointError, latest_complete, list_steps, read_marker, step_dir
from titan_hydra.models.hf_io import is_hf_dir


def resume_target(folder: Path, load_step: int, log: Callable[[str], None]) -> Path | None:
    """The step dir this run resumes from: ``load_step`` when >= 0 (it must be complete), else
    the newest complete one; None when the folder holds none."""
    if load_step >= 0:
        path = step_dir(folder, load_step)
        if read_marker(path) is None:
            raise CheckpointError(
                f"checkpoint.load_step={load_step}: {path} is missing or incomplete (no {path.name}/"
                "COMPLETE.json); pick a step with a complete checkpoint"
            )
        return path
    best, skipped = latest_complete(folder)
    for s in skipped:
        log(f"ignoring incomplete checkpoint {s.path} (no completion marker: the save was interrupted)")
    return best.path if best else None


def initial_target(path: str | Path) -> tuple[Path, bool]:
    """``initial_load_path`` resolved: (the directory to load, whether it is an HF directory).
    A checkpoint folder stands for its newest complete step dir."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"checkpoint.initial_load_path={path} does not exist")
    if is_hf_dir(path):
        return path, True
    if not (path / ".metadata").exists():
        best, _ = latest_complete(path)
        if best is None:
            raise CheckpointError(f"checkpoint.initial_load_path={path} holds no complete checkpoint")
        path = best.path
    return path, False


def saved_model_only(path: Path) -> bool:
    """Whether the checkpoint at ``path`` is a model-only export (its marker says so)."""
    marker = read_marker(path)
    return bool(marker and marker.get("kind") == "model_only")


def create_seed(saver: Saver) -> int:
    """``create_seed_checkpoint``: save the freshly initialized model (step 0, model only) so that
    runs of any layout start from the same weights. Returns the step (0)."""
    if saver.run.world_size != 1:
        raise CheckpointError(
            "checkpoint.create_seed_checkpoint=true runs in one process: set cluster.nproc_per_node=1 "
            "and parallelism=single"
        )
    saver.save(0, model_only=True, dtype="float32", wait=True)
    return 0


def branch_point(path: str | Path) -> int:
    """The step of the checkpoint a branch (``lr_scheduler=cooldown``) starts from: a complete step
    dir, or a checkpoint folder's newest. A missing one is one line naming the steps the base saved."""
    path = Path(path).expanduser()
    target = path if (path / ".metadata").exists() or STEP_RE.match(path.name) else None
    folder = path.parent if target is not None else path
    saved = [s.step for s in list_steps(folder) if s.complete]
    if target is None:
        if not saved:
            raise CheckpointError(f"checkpoint.initial_load_path={path} holds no complete checkpoint to branch "
                                  "from: run the base with checkpoint.enable=true and checkpoint.interval=<steps>")
        target = step_dir(folder, saved[-1])
    marker = read_marker(target)
    if marker is None:
        fix = (f"the base saved steps {saved}: branch at one of those" if saved else
               f"{folder} holds none: run the base with checkpoint.enable=true and checkpoint.interval=<steps>")
        raise CheckpointError(f"checkpoint.initial_load_path={target}: no complete checkpoint to branch from; {fix}")
    if marker.get("kind") == "model_only":
        raise CheckpointError(f"checkpoint.initial_load_path={target} is a model-only export: a cooldown branch "
                              "continues the base's optimizer and data, so it needs a full checkpoint")
    return int(marker["step"])
