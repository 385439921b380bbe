"""Hangs: a watchdog thread per rank ends a run that stopped making progress.

The training loop beats at each phase of each step. A rank whose last beat is older than
``hang_timeout_s`` writes, to ``<run>/hang/``: its Python stacks (faulthandler, every thread),
torch's collective flight recorder (``TORCH_FR_BUFFER_SIZE``, set before the process group starts;
it records gloo and NCCL collectives) and its last beat. It then waits briefly for the other
ranks' files (their watchdogs fire too: they are blocked in a collective waiting for the one that
stopped), the lowest rank that wrote one restarts the run (``restart``: inside a SLURM job it
requeues the job, ``runtime/preemption.requeue_on_hang``; elsewhere it leaves that to the
launcher) and prints one line naming the rank that stopped first (the earliest step and phase)
and what was done; the other ranks wait for that line's decision, then every rank exits with
``HANG_EXIT_CODE`` so the launcher's restarts (or the requeued job) start the run again from its
last checkpoint.

Reports are per attempt (``attempt_id``): a restarted run keeps the first hang's files, and a
second hang in the same run dir must not read them as its own.
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
from typing import Callable

try:  # the flight recorder's dump (torch >= 2.6); without it the report says so
    from torch._C._distributed_c10d import _dump_fr_trace_json
except ImportError:
    _dump_fr_trace_json = None

HANG_DIR = "hang"  # under the run dir
HANG_EXIT_CODE = 75  # EX_TEMPFAIL: try again (a restart resumes from the last checkpoint)
FLIGHT_RECORDER_ENV = "TORCH_FR_BUFFER_SIZE"
FLIGHT_RECORDER_ENTRIES = "2000"
PHASES = ("forward/backward", "optimizer", "done")  # a step's phases, in order (step 0: "done")
RESTART_BY_LAUNCHER = f"exiting {HANG_EXIT_CODE} so the run restarts from its last checkpoint"
DECISION = "decision.json"  # the reporting rank's line, which the other ranks wait for before exiting
# What every rank of one attempt shares without talking: SLURM's job and requeue count, or torch
# elastic's run id and restart count (launch.local, torchrun).
ATTEMPT_ENV = ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


def attempt_id() -> str:
    return "/".join(os.environ.get(k, "") for k in ATTEMPT_ENV)


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

    def __init__(self, timeout_s: float, run_dir: str, rank: int, world_size: int,
                 restart: Callable[[], str] | None = None) -> None:
        """``restart`` runs on the reporting rank once the reports are in: it restarts the run (or
        says why it could not) and returns the hang line's ending; None leaves it to the launcher."""
        self.timeout_s, self.rank, self.world_size = timeout_s, rank, world_size
        self.restart = restart or (lambda: RESTART_BY_LAUNCHER)
        self.attempt = attempt_id()
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
                  "phase": phase, "last_beat_unix": at, "flight_recorder": recorder, "attempt": self.attempt}
        _write_json(self.dir / f"rank{self.rank}.json", report)
        reports = self._collect(grace_s=min(10.0, max(2.0, self.timeout_s / 2)))
        if min(reports) == self.rank:
            line = hang_line(reports, self.timeout_s, self.dir, self.world_size, self.restart())
            print(line, file=sys.stderr, flush=True)
            _write_json(self.dir / DECISION, {"attempt": self.attempt, "rank": self.rank, "line": line})
        else:  # leave after the reporter restarted the run: a launcher may stop every rank once one exits
            self._wait_for_decision(deadline_s=90.0)

    def _read(self, name: str) -> dict | None:
        """A report of this attempt, or None (missing, being written, or an earlier attempt's)."""
        try:
            r = json.loads((self.dir / name).read_text())
        except (OSError, ValueError):
            return None
        return r if r.get("attempt") == self.attempt else None

    def _collect(self, grace_s: float) -> dict[int, dict]:
        """Every rank's report that arrives within ``grace_s``."""
        deadline = time.time() + grace_s
        while True:
            reports = {int(r["rank"]): r for r in map(self._read, (p.name for p in self.dir.glob("rank*.json"))) if r}
            if len(reports) >= self.world_size or time.time() > deadline:
                return reports
            time.sleep(0.2)

    def _wait_for_decision(self, deadline_s: float) -> None:
        deadline = time.time() + deadline_s
        while self._read(DECISION) is None and time.time() < deadline:
            time.sleep(0.2)


def _write_json(path: Path, value: dict) -> None:
    """Whole or not at all (the other ranks poll for it): write aside, then rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def hang_line(reports: dict[int, dict], timeout_s: float, where: Path, world_size: int,
              outcome: str = RESTART_BY_LAUNCHER) -> str:
    """One line: the rank that stopped first (earliest step, then phase, then time), where the
    stacks are, and ``outcome`` (what happens next)."""
    first = min(reports.values(),
                key=lambda r: (r["step"], PHASES.index(r["phase"]) if r["phase"] in PHASES else 0, r["last_beat_unix"]))
    missing = sorted(set(range(world_size)) - set(reports))
    return (f"hang: rank {first['rank']} ({first['host']}) stopped first, in step {first['step']} "
            f"({first['phase']}); no progress for {timeout_s:g} s; stacks of rank(s) {sorted(reports)} in {where}"
            + (f" (no report from rank(s) {missing})" if missing else "")
            + f"; {outcome}")
