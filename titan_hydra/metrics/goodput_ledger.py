"""The live goodput ledger: what the trainer tells it, written to ``<run dir>/goodput.jsonl``.

The trainer attributes the time it knows the purpose of (``add`` / ``span``: data wait,
checkpoint saves, evaluation, straggler wait) and closes each kept step with ``step``: every second
since the previous record that nothing claimed is the step's compute. A record is written and
flushed after every step, so a process killed without any cleanup (SIGKILL, the OOM killer, a
lost node) leaves a ledger complete up to its last step, and the next attempt continues it: the
record format and how restarts are read back are in ``goodput.py``.

Rank 0 writes; the other ranks keep nothing. A ledger that cannot be read (a corrupt line) never
stops the run: one console line says so and the ledger restarts after a marker.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from titan_hydra.metrics.goodput import LEDGER, Tally, launcher_started, process_start_time, read_records, tally_of

# Where this process's previous run ended (Hydra's in-process multirun, tests): the next run's
# start-up counts from there, not from the process start.
_last_close: list[float] = []
# The ledger of the last run that closed, while no other run started after it: the process's
# exit (Hydra's job end, the interpreter's exit hooks) is appended to it as a last ``other``.
_closed: list[Path] = []


@atexit.register
def _record_exit() -> None:
    if _closed and _last_close:
        now = time.time()
        try:
            with _closed[0].open("a", encoding="utf-8") as f:
                f.write(json.dumps({"kind": "end", "t": now, "s": {"other": round(now - _last_close[0], 6)}},
                                   separators=(",", ":")) + "\n")
        except OSError:
            pass  # the run dir is gone (a test's temporary one): nothing to account to
        _closed.clear()


def relaunched() -> bool:
    """Whether torch elastic restarted this worker after a failure of the same run (its agent sets
    the count); a rerun by hand or a SLURM requeue (queue time is not the run's) is not."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


class GoodputLedger:
    """One attempt's share of the run's ledger. ``own_s``: the time spent in the ledger itself."""

    def __init__(self, run_dir: str | os.PathLike, rank: int) -> None:
        self.path = Path(run_dir) / LEDGER
        self.active = rank == 0
        self.started = max([self._process_or_launcher_start(), *_last_close])
        self.tally = Tally()
        self.pending: dict[str, float] = {}
        self.mark = time.perf_counter()
        self.first_step = True
        self.own_s = 0.0
        self._file = None

    @staticmethod
    def _process_or_launcher_start() -> float:
        """The start of this attempt: the local launcher's, where it started this worker (its
        composing, validation and data preparation came first); a worker torch elastic restarted
        counts from the dead attempt instead (``begin``)."""
        launcher = launcher_started()
        if launcher is None or relaunched():
            return process_start_time()
        return min(process_start_time(), launcher)

    # ---------------------------------------------------------------- attempt start and end
    def begin(self, resumed_step: int) -> None:
        """This attempt reaches its first step (after any restore) at ``resumed_step``."""
        _closed.clear()  # this process's previous run is over: its exit is this run's start-up
        if not self.active:
            return
        t0 = time.perf_counter()
        records, problem = read_records(self.path)
        self._file = self.path.open("a", encoding="utf-8")
        if problem is not None:
            print(f"goodput: {self.path} is corrupt ({problem}); the run goes on and the ledger restarts here "
                  "(the time before is not counted)", flush=True)
            if self.path.stat().st_size and not self.path.read_bytes().endswith(b"\n"):
                self._file.write("\n")  # a torn last line stays on its own line
            self._write({"kind": "restarted", "t": time.time(), "reason": problem})
        else:
            self.tally = tally_of(records)
        now = time.time()
        startup = "warmup" if self.tally.ended else "lost"  # after a death the start-up is the restart's cost
        if startup == "lost" and relaunched() and 0 < self.tally.last_t < self.started:
            # torch elastic restarted this worker at once: the dead attempt's last seconds (a hang until
            # the watchdog fired, the agent's restart) belong to this run too
            self.started = self.tally.last_t
        self._write({"kind": "start", "t": self.started, "resumed_step": int(resumed_step), "pid": os.getpid(),
                     "host": socket.gethostname(), "s": {startup: now - self.started}})
        self.mark = time.perf_counter()
        self.own_s += self.mark - t0

    def close(self) -> None:
        """After the run's last step and its loggers closed: the shutdown, and the end record."""
        if self.active and self._file is not None:
            self._write({"kind": "end", "t": time.time(), "s": {"other": self._unclaimed()}})
            self._file.close()
            self._file = None
            _closed[:] = [self.path]
        _last_close[:] = [time.time()]

    # ---------------------------------------------------------------- what the trainer tells it
    def add(self, category: str, seconds: float) -> None:
        """``seconds`` of the time since the previous record went to ``category``."""
        if seconds:
            self.pending[category] = self.pending.get(category, 0.0) + float(seconds)

    @contextmanager
    def span(self, category: str) -> Iterator[None]:
        """The time inside the ``with`` block goes to ``category``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(category, time.perf_counter() - t0)

    def unkept(self, category: str = "health") -> None:
        """The step just tried was not kept: its unclaimed time goes to ``category`` (``health``:
        skipped by the health checks; ``lost``: dropped by torchft when a group failed), written with
        the next kept step."""
        self.add(category, max(time.perf_counter() - self.mark - sum(self.pending.values()), 0.0))

    def step(self, step: int) -> None:
        """Step ``step`` was kept: write the record of everything since the previous one."""
        if not self.active or self._file is None:
            self.pending.clear()
            return
        t0 = time.perf_counter()
        main = "warmup" if self.first_step else "productive"
        self.first_step = False
        self._write({"kind": "step", "step": int(step), "t": time.time(), "s": {main: self._unclaimed(t0)}})
        self.own_s += time.perf_counter() - t0

    def _unclaimed(self, now: float | None = None) -> float:
        """Seconds since the previous record that no category claimed (the pending ones are moved
        into the record being written: ``_write`` takes them)."""
        now = time.perf_counter() if now is None else now
        rest = now - self.mark - sum(self.pending.values())
        self.mark = now
        return rest

    def _write(self, record: dict[str, Any]) -> None:
        seconds = record.setdefault("s", {})
        for category, value in self.pending.items():
            seconds[category] = seconds.get(category, 0.0) + value
        self.pending.clear()
        record["s"] = {c: round(v, 6) for c, v in seconds.items() if v}
        self.tally.add(record)
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()  # a killed process loses no step: the page cache survives the process

    # ---------------------------------------------------------------- what it reports
    def metrics(self) -> dict[str, float]:
        """``goodput/*`` so far (through the previous record), for the metric loggers."""
        return self.tally.metrics() if self.active else {}

    def summary(self) -> dict[str, Any] | None:
        if not self.active:
            return None
        return {**self.tally.summary(), "own_s": self.own_s}
