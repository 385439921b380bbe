"""Profiling: torch.profiler traces and memory snapshots every ``profiling.profile_freq`` steps.

The Trainer calls ``profiler.step()`` once after every optimizer step; nothing else in the loop
knows about profiling. Traces (Chrome/Perfetto JSON) go to
``<run_dir>/<traces_folder>/iteration_<step>/rank<r>_trace.json``, next to a per-op summary
(``rank<r>_ops.txt`` / ``.json``: self time and calls per op); the profiler waits
``profile_freq - warmup - active`` steps, warms up ``warmup`` steps, records ``active`` steps.

Memory snapshots go to ``<run_dir>/<memory_snapshot_folder>/iteration_<step>/``:
* CUDA: the caching allocator's history (``rank<r>_memory_snapshot.pickle``, open it at
  https://pytorch.org/memory_viz).
* CPU has no allocator history, so the snapshot is a tensor-level account of the step instead
  (``rank<r>_memory.json``): peak bytes of live tensors by category (parameters, gradients,
  optimizer state, activations, temporaries), tracked by torch's dispatch-level MemTracker over the
  whole step. That is the CPU analogue of ``torch.cuda.max_memory_allocated`` and what the
  estimator is validated against (process RSS would add ~0.4 GiB of libraries and allocator slack).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from titan_hydra.errors import UserError

log = logging.getLogger("titan_hydra")
MIB = 1024**2


def tensor_peak_bytes(tracker) -> dict[str, int]:
    """Peak per category (+ Total) of a MemTracker, summed over devices."""
    out: dict[str, int] = {}
    for per_dev in tracker.get_tracker_snapshot("peak").values():
        for kind, nbytes in per_dev.items():
            key = str(getattr(kind, "value", kind)).lower()
            out[key] = out.get(key, 0) + int(nbytes)
    return out


def _step_tracker():
    """torch's MemTracker, accepting a root module that runs forward several times in one step.

    Pipeline microbatches and gradient accumulation call a model part's forward more than once per
    optimizer step; MemTracker refuses that (it keeps per-module stats for one call). Only the
    step's global peak is read here, so a root module's stats from its earlier call are dropped
    when it runs again; the tensors themselves stay tracked.
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    class StepMemTracker(MemTracker):
        def _pre_fw_hook(self, module, inputs):
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                parents = set(self._mod_tracker.parents) - {self._mod_tracker.get_known_fqn(module)}
                if parents == {"Global"}:
                    del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

    return StepMemTracker()


class Profiler:
    """Owns the torch.profiler session and the memory snapshot window of one rank. Its settings
    are the ``profiling`` group's, passed on by ``build_profiler`` (which holds their defaults)."""

    def __init__(self, run_dir: str, rank: int, model_parts: list[torch.nn.Module],
                 optimizer: torch.optim.Optimizer | None, device: torch.device, *, enable: bool,
                 traces_folder: str, profile_freq: int, warmup: int, active: int, enable_memory_snapshot: bool,
                 memory_snapshot_folder: str) -> None:
        self.rank, self.device = rank, device
        self.model_parts, self.optimizer = model_parts, optimizer
        self.freq, self.warmup, self.active = int(profile_freq), int(warmup), int(active)
        self.snapshots = bool(enable_memory_snapshot)
        self.step_num = 0
        self.trace_dir = Path(run_dir) / traces_folder
        self.mem_dir = Path(run_dir) / memory_snapshot_folder
        self.torch_profiler = self._start_trace() if enable else None
        self.tracker = None
        self.memory_records: list[dict[str, Any]] = []
        if self.snapshots:
            if device.type == "cuda":
                torch.cuda.memory._record_memory_history(max_entries=100_000)
            self._maybe_open_window()

    # --- traces ---------------------------------------------------------------------
    def _start_trace(self):
        from torch.profiler import ProfilerActivity, profile, schedule

        active = max(1, self.active)
        warmup = max(0, min(self.warmup, self.freq - active))
        wait = max(0, self.freq - warmup - active)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])

        def on_ready(prof) -> None:
            folder = self.trace_dir / f"iteration_{self.step_num}"
            folder.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(folder / f"rank{self.rank}_trace.json"))
            self._write_op_summary(prof, folder)

        prof = profile(activities=activities, schedule=schedule(wait=wait, warmup=warmup, active=active),
                       on_trace_ready=on_ready, record_shapes=True)
        prof.start()
        return prof

    def _write_op_summary(self, prof, folder: Path) -> None:
        """Where the step's time went, without opening the trace: the ops by self time.

        ``rank<r>_ops.txt`` is torch.profiler's key-averages table; ``rank<r>_ops.json`` the
        same numbers (self/total microseconds and call counts per op) for scripts.
        """
        sort_key = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        averages = prof.key_averages()
        (folder / f"rank{self.rank}_ops.txt").write_text(averages.table(sort_by=sort_key, row_limit=40))
        ops = {
            e.key: {"calls": int(e.count), "self_cpu_us": float(e.self_cpu_time_total),
                    "cpu_total_us": float(e.cpu_time_total)}
            for e in averages
        }
        (folder / f"rank{self.rank}_ops.json").write_text(json.dumps(ops, indent=1, sort_keys=True))

    # --- memory ---------------------------------------------------------------------
    def _snapshot_due(self, step: int) -> bool:
        """Steps whose memory is recorded: the 2nd (optimizer state exists) and every freq-th."""
        return step == 2 or (step > 0 and step % self.freq == 0)

    def _maybe_open_window(self) -> None:
        """On CPU, track tensors over the coming step if it is a snapshot step."""
        if self.device.type == "cuda" or not self._snapshot_due(self.step_num + 1):
            return
        tracker = _step_tracker()
        tracker.track_external(*self.model_parts, *([self.optimizer] if self.optimizer else []))
        tracker.__enter__()
        self.tracker = tracker

    def _close_window(self) -> None:
        if self.tracker is None:
            return
        tracker, self.tracker = self.tracker, None
        tracker.__exit__(None, None, None)
        peaks = tensor_peak_bytes(tracker)
        record = {"step": self.step_num, "rank": self.rank, "peak_bytes": peaks,
                  "peak_mib": {k: v / MIB for k, v in peaks.items()}}
        self.memory_records.append(record)
        folder = self.mem_dir / f"iteration_{self.step_num}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{self.rank}_memory.json").write_text(json.dumps(record, indent=1))

    def _dump_cuda_snapshot(self) -> None:
        if self.device.type != "cuda" or not self._snapshot_due(self.step_num):
            return
        folder = self.mem_dir / f"iteration_{self.step_num}"
        folder.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(folder / f"rank{self.rank}_memory_snapshot.pickle"))

    # --- called by the Trainer ------------------------------------------------------
    def step(self) -> None:
        self.step_num += 1
        if self.torch_profiler is not None:
            self.torch_profiler.step()
        if self.snapshots:
            self._close_window()
            self._dump_cuda_snapshot()
            self._maybe_open_window()

    def close(self) -> None:
        if self.tracker is not None:  # a window opened for a step that never ran
            self.tracker.__exit__(None, None, None)
            self.tracker = None
        if self.torch_profiler is not None:
            self.torch_profiler.stop()
            self.torch_profiler = None
        if self.snapshots and self.device.type == "cuda":
            torch.cuda.memory._record_memory_history(enabled=None)


def build_profiler(*, run_dir: str, rank: int, model_parts, optimizer, device, enable: bool = False,
                   traces_folder: str = "profile_traces", profile_freq: int = 10, warmup: int = 3, active: int = 1,
                   enable_memory_snapshot: bool = False, memory_snapshot_folder: str = "memory_snapshot"
                   ) -> Profiler | None:
    """The ``profiling`` group's target (a partial; the recipe adds the run's parts): a Profiler
    when traces or memory snapshots are enabled, else None (zero overhead)."""
    if not (enable or enable_memory_snapshot):
        return None
    if int(profile_freq) < 1:
        raise UserError(f"profiling.profile_freq={profile_freq} must be >= 1")
    return Profiler(run_dir, rank, model_parts, optimizer, device, enable=enable, traces_folder=traces_folder,
                    profile_freq=profile_freq, warmup=warmup, active=active,
                    enable_memory_snapshot=enable_memory_snapshot, memory_snapshot_folder=memory_snapshot_folder)
