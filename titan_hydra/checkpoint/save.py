"""Writing checkpoints: synchronous and asynchronous saves, the completion marker, keep-latest-k.

A save goes to ``step-N/`` and counts once rank 0 wrote the completion marker after every rank
finished (a barrier for sync saves; for async saves rank 0's DCP future, which only resolves
after DCP gathered every rank's write results and wrote ``.metadata``). Async saves use a
dedicated gloo process group (made by the caller) so that their background collectives never
interleave with the training step's collectives on the default group.

A save that fails (disk full, an unwritable folder) stops the run with one line; its step dir
never gets a marker (rank 0 removes what was written), and the previous complete checkpoint is
untouched: older ones are only purged after a newer one is complete.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from titan_hydra.checkpoint.state import RunParts, export_dtype
from titan_hydra.checkpoint.storage import (
    DCP_ERRORS,
    CheckpointError,
    latest_complete,
    list_steps,
    remove_dir,
    step_dir,
    write_marker,
)
from titan_hydra.errors import first_line
from titan_hydra.quiet import DCP_SINGLE_PROCESS, ignoring


def root_cause(error: BaseException) -> str:
    """One line for a failed save: DCP wraps each rank's OSError (ENOSPC...) in CheckpointException."""
    seen = error
    for _ in range(8):
        failures = getattr(seen, "failures", None)  # DCP's CheckpointException: {rank: exception}
        if isinstance(failures, dict) and failures:
            rank, inner = sorted(failures.items())[0]
            inner = inner[0] if isinstance(inner, tuple) else inner
            if isinstance(inner, BaseException):
                return f"rank {rank}: {root_cause(inner)}"
        if seen.__cause__ is None:
            break
        seen = seen.__cause__
    return first_line(seen)


def purge(folder: Path, keep_latest_k: int) -> None:
    """Keep the newest ``keep_latest_k`` complete checkpoints (all when <= 0); drop incomplete ones
    older than the newest complete one (interrupted saves that will never finish)."""
    steps = list_steps(folder)
    complete = [s for s in steps if s.complete]
    doomed = complete[:-keep_latest_k] if keep_latest_k > 0 else []
    newest = complete[-1].step if complete else -1
    doomed += [s for s in steps if not s.complete and s.step < newest]
    for s in doomed:
        remove_dir(s.path)


class Saver:
    """Saves ``run`` under ``folder``; at most one async save in flight (the next save waits)."""

    def __init__(self, run: RunParts, folder: Path, *, async_mode: bool, keep_latest_k: int,
                 process_group=None) -> None:
        self.run = run
        self.folder = folder
        self.async_mode = async_mode
        self.keep_latest_k = keep_latest_k
        self._pg = process_group
        self._pending: tuple | None = None
        self._stager = None

    def save(self, step: int, model_only: bool = False, dtype: str = "float32", wait: bool = False) -> Path:
        """Save step ``step``; async unless ``wait`` or async is off. Returns the step dir."""
        run = self.run
        self.wait()
        path = step_dir(self.folder, step)
        if run.rank == 0:
            if path.exists():  # a save of this step that never completed (killed run)
                remove_dir(path)
            path.mkdir(parents=True, exist_ok=True)
        run.barrier()
        t0 = time.perf_counter()
        torch_dtype = export_dtype(dtype) if model_only else None
        state = run.state_to_save(model_only=model_only, dtype=torch_dtype)
        info = run.marker_info(step, "model_only" if model_only else "full", dtype)
        if self.async_mode and not wait:
            fut = dcp.async_save(state, checkpoint_id=str(path), process_group=self._pg,
                                 async_stager=self._get_stager())
            fut = getattr(fut, "upload_completion", fut)
            self._pending = (fut, step, path, info, t0)
            run.log(f"step {step}: async save started ({time.perf_counter() - t0:.2f}s blocking)")
            return path
        try:
            with ignoring(DCP_SINGLE_PROCESS):  # a 1-rank run saves without a process group
                dcp.save(state, checkpoint_id=str(path))
        except DCP_ERRORS as e:
            self._failed(step, path, e)
        run.barrier()
        self._complete(step, path, info, t0)
        return path

    def _failed(self, step: int, path: Path, error: BaseException) -> None:
        """A save that did not finish: remove it (rank 0) and stop the run with one line."""
        if self.run.rank == 0:
            remove_dir(path)
        best, _ = latest_complete(self.folder)
        kept = f"the newest complete checkpoint {best.path} is intact" if best else "no earlier checkpoint exists"
        reason = root_cause(error)
        raise CheckpointError(f"saving checkpoint step {step} to {path} failed ({reason}); {kept}") from error

    def _get_stager(self):
        """Reusable staging buffers; pinned memory and async copies only where CUDA exists."""
        if self._stager is None:
            cuda = torch.cuda.is_available()
            self._stager = DefaultStager(StagingOptions(cuda, False, cuda, cuda))
        return self._stager

    def _complete(self, step: int, path: Path, info: dict[str, Any], t0: float) -> None:
        if self.run.rank == 0:
            try:
                write_marker(path, info)
            except DCP_ERRORS as e:
                self._failed(step, path, e)
            self.run.log(f"step {step}: saved {path} ({info['kind']}, {time.perf_counter() - t0:.2f}s)")
            purge(self.folder, self.keep_latest_k)

    def poll(self) -> None:
        """Finish a background save whose data is all on disk (non-blocking)."""
        if self._pending is not None and self._pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Block until a pending async save is complete and marked."""
        if self._pending is None:
            return
        fut, step, path, info, t0 = self._pending
        self._pending = None
        try:
            fut.result()
        except DCP_ERRORS as e:
            self._failed(step, path, e)
        self._complete(step, path, info, t0)

    def close(self) -> None:
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None
