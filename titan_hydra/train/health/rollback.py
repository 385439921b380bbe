"""Too many skipped steps in a row: back to the last checkpoint, past the data that led there.

Every rank rolls back together (the skip decision that triggers it is the same everywhere). The
loader's position at the failure is kept across the load, so training resumes from the
checkpoint's weights, optimizer and schedule but with the data after the bad window: the window
(checkpoint step .. failed step, and the loader positions around it) goes to
``<run>/health/skipped_data.jsonl`` and to the console.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from titan_hydra.checkpoint import resume
from titan_hydra.errors import TrainingDiverged

SKIPPED_DATA = "health/skipped_data.jsonl"


def position(loader: Any) -> Any:
    """The loader's place in its stream, as it counts it (samples consumed; else its whole state)."""
    sd = loader.state_dict() if hasattr(loader, "state_dict") else {}
    return sd.get("consumed", sd) if isinstance(sd, dict) else sd


class Rollback:
    """Up to ``max_rollbacks`` rollbacks; the next need for one stops the run with one line."""

    def __init__(self, checkpointer: Any, loader: Any, state: Any, run_dir: str, rank: int,
                 max_rollbacks: int) -> None:
        self.checkpointer, self.loader, self.state = checkpointer, loader, state
        self.path = Path(run_dir) / SKIPPED_DATA
        self.rank, self.max_rollbacks = rank, max_rollbacks
        self.done = 0

    def target(self) -> Path | None:
        ckpt = self.checkpointer
        if ckpt is None or not ckpt.enabled:
            return None
        ckpt.wait()  # an async save in flight may be the newest checkpoint
        return resume.resume_target(ckpt.folder, -1, lambda _m: None)

    def __call__(self, detail: str, skipped: int, reason: str) -> str:
        """Roll back (returns the console line) or raise TrainingDiverged (one line) when it cannot.
        ``detail``: what the last skipped step saw ("loss is nan"); ``reason``: "non-finite" or "spike"."""
        failed = self.state.step + 1
        head = f"{detail} at step {failed}: {skipped} steps in a row skipped ({reason})"
        why = f"{reason}: {detail}"
        if self.done >= self.max_rollbacks:
            raise TrainingDiverged(f"{head} after {self.done} rollback(s) (health.max_rollbacks="
                                   f"{self.max_rollbacks}); the run stops, skipped data in {self.path}")
        target = self.target()
        if target is None:
            raise TrainingDiverged(f"{head} and no checkpoint to roll back to (checkpoint=default saves them); "
                                   "lower optimizer.lr, keep training.max_norm > 0, or use training.mixed_precision=fp32")
        after = copy.deepcopy(self.loader.state_dict())
        self.checkpointer.load(target, model_only=resume.saved_model_only(target))
        before = position(self.loader)
        self.loader.load_state_dict(after)  # past the window that led to the failure
        self.done += 1
        record = {"rollback": self.done, "failed_step": failed, "to_step": self.state.step,
                  "data_from": before, "data_to": position(self.loader), "why": why}
        if self.rank == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        return (f"rollback {self.done}/{self.max_rollbacks}: step {failed} -> checkpoint step {self.state.step}; "
                f"data [{before}, {record['data_to']}) skipped (written to {self.path})")
