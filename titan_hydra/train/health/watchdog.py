"""Hangs: a watchdog thread per rank ends a run that stopped making progress.

The training loop beats at each phase of each step. A rank whose last beat is older than
``hang_timeout_s`` writes, to ``<run>/hang/``: its Python stacks (faulthandler, every thread),
torch's collective flight recorder (``TORCH_FR_BUFFER_SIZE``, set before the process group starts;
it records gloo and NCCL collectives) and its last beat. It then waits briefly for the other
ranks' files (their watchdogs fire too: they are blocked in a collective waiting for the one that
stopped), the lowest rank that wrote one prints one line naming the rank that stopped first (the
earliest step and phase), and every rank exits with ``HANG_EXIT_CODE`` so the launcher's restarts
or a SLURM requeue start the run again from its last checkpoint.
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

try:  # the flight recorder's dump (torch >= 2.6); without it the report says so
    from torch._C._distributed_c10d import _dump_fr_trace_json
except ImportError:
    _dump_fr_trace_json = None

HANG_DIR = "hang"  # under the run dir
HANG_EXIT_CODE = 75  # EX_TEMPFAIL: try again (a restart resumes from the last checkpoint)
FLIGHT_RECORDER_ENV = "TORCH_FR_BUFFER_SIZE"
FLIGHT_RECORDER_ENTRIES = "2000"
PHASES = ("forward/backward", "optimizer", "done")  # a step's phases, in order (step 0: "done")


def enable_flight_recorder() -> None:
    """Before the process group starts: keep the last collectives for a hang report (a user's setting wins)."""
    os.environ.setdefault(FLIGHT_RECORDER_ENV, FLIGHT_RECORDER_ENTRIES)


def dump_flight_recorder(path: Path) -> str:
    """torch's flight recorder as JSON at ``path``; says what was written, or why nothing."""
    if _dump_fr_trace_json is None:
        return "this torch has no flight recorder"
    if not os.environ.get(FLIGHT_RECORDER_ENV):
        return f"flight recorder off ({FLIGHT_RECORDER_ENV} unset)"
    try:
        path.write_bytes(_dump_fr_trace_json(True, True))
    except RuntimeError as e:  # no process group, or a backend without a recorder
        return f"no flight recorder here ({str(e).splitlines()[0]})"
    return f"flight recorder {path.name}"


class Watchdog:
    """``beat(step, phase)`` from the loop; a daemon thread checks the time since the last one."""

    def __init__(self, timeout_s: float, run_dir: str, rank: int, world_size: int) -> None:
        self.timeout_s, self.rank, self.world_size = timeout_s, rank, world_size
        self.dir = Path(run_dir) / HANG_DIR
        self.last = (0, "done", time.time())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="titan-hang-watchdog", daemon=True)

    def start(self, step: int) -> None:
        self.beat(step, "done")
        self._thread.start()

    def beat(self, step: int, phase: str) -> None:
        self.last = (step, phase, time.time())

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        poll = min(5.0, max(self.timeout_s / 10, 0.05))
        while not self._stop.wait(poll):
            if time.time() - self.last[2] > self.timeout_s:
                self.fire()

    def fire(self) -> None:
        """Write this rank's report, name the rank that stopped first, exit the process (whatever
        the report met: a hung run must end)."""
        try:
            self._report()
        finally:
            os._exit(HANG_EXIT_CODE)

    def _report(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / f"rank{self.rank}.stacks.txt", "w") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
        recorder = dump_flight_recorder(self.dir / f"flight_recorder.rank{self.rank}.json")
        step, phase, at = self.last
        report = {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(), "step": step,
                  "phase": phase, "last_beat_unix": at, "flight_recorder": recorder}
        (self.dir / f"rank{self.rank}.json").write_text(json.dumps(report))
        reports = self._collect(grace_s=min(10.0, max(2.0, self.timeout_s / 2)))
        if min(reports) == self.rank:
            print(hang_line(reports, self.timeout_s, self.dir, self.world_size), file=sys.stderr, flush=True)

    def _collect(self, grace_s: float) -> dict[int, dict]:
        """Every rank's report that arrives within ``grace_s``."""
        deadline = time.time() + grace_s
        while True:
            reports = {}
            for path in self.dir.glob("rank*.json"):
                try:
                    r = json.loads(path.read_text())
                except (OSError, ValueError):
                    continue  # being written
                reports[int(r["rank"])] = r
            if len(reports) >= self.world_size or time.time() > deadline:
                return reports
            time.sleep(0.2)


def hang_line(reports: dict[int, dict], timeout_s: float, where: Path, world_size: int) -> str:
    """One line: the rank that stopped first (earliest step, then phase, then time) and where the stacks are."""
    first = min(reports.values(),
                key=lambda r: (r["step"], PHASES.index(r["phase"]) if r["phase"] in PHASES else 0, r["last_beat_unix"]))
    missing = sorted(set(range(world_size)) - set(reports))
    return (f"hang: rank {first['rank']} ({first['host']}) stopped first, in step {first['step']} "
            f"({first['phase']}); no progress for {timeout_s:g} s; stacks of rank(s) {sorted(reports)} in {where}"
            + (f" (no report from rank(s) {missing})" if missing else "")
            + f"; exiting {HANG_EXIT_CODE} so the run restarts from its last checkpoint")
