"""Goodput: where a run's wall time went, by category, across every restart of its run dir.

The ledger (``goodput_ledger.py``) appends one JSON object per line to ``<run dir>/goodput.jsonl``:

* ``{"kind": "start", "t": <epoch of the process start>, "resumed_step": s, "s": {<cat>: seconds}}``
  when an attempt (a process of the run) reaches its first step; ``s`` holds its start-up
  (imports, build, restore): ``warmup`` for the run's first attempt or one after a clean end,
  ``lost`` after an attempt that died (killed, requeued, crashed: it wrote no ``end``).
* ``{"kind": "step", "step": n, "t": <epoch>, "s": {...}}`` after each kept step: every second
  since the previous record, by category (the step's compute in ``productive``, or ``warmup`` for
  an attempt's first step). A record may carry a negative ``productive``: a straggler gather moves
  the wait of the steps since the previous gather out of it.
* ``{"kind": "end", ...}`` after the last step's shutdown (``other``), and
  ``{"kind": "restarted", "reason": ...}`` where a corrupt ledger was restarted.

The file holds facts as they were measured; what a later event makes of earlier steps is decided
when it is read (``Tally``): an attempt whose first kept step is ``s + 1`` (it resumed from a
checkpoint of step ``s``, or healed from a torchft peer at ``s``) turns the earlier attempts' steps
after ``s`` into ``lost`` (trained twice), and a step number that comes again within an
attempt (a health rollback to a checkpoint) turns the steps it redoes into ``health``. So the
categories always sum to the wall time the records cover, and the live ledger and
``recipes/goodput.py`` reading the file agree.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LEDGER = "goodput.jsonl"

# category -> what it holds (the order of the ledger's tables)
CATEGORIES: dict[str, str] = {
    "productive": "compute of the steps that were kept",
    "data_wait": "waiting for the next batch",
    "checkpoint": "checkpoint saves (their blocking part)",
    "eval": "validation and in-loop evaluation",
    "warmup": "start-up to the first step, and each attempt's first step (compile, allocation)",
    "health": "skipped steps, and steps redone after a health rollback",
    "straggler_wait": "the fastest rank waiting on the slowest (health straggler timings)",
    "lost": "lost to failures: steps trained twice after a restart, the restart's start-up, steps torchft dropped",
    "other": "shutdown after the last step (loggers, process groups)",
}


class LedgerCorrupt(ValueError):
    """A line of the ledger that is not one of its records."""


def process_start_time() -> float:
    """This process's start as a Unix time: ``/proc/self/stat``'s start time (clock ticks since
    boot) against the boot-time clock, so interpreter start and imports are counted; the time of
    this module's import where ``/proc`` is missing."""
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22; the command name may hold spaces
        since_start = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - since_start
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED


_IMPORTED = time.time()

# Set by the local launcher for the workers it starts: when its own start-up began. A worker forked
# from the fork server starts after the launcher composed, validated and prepared the data; that
# time is the run's start-up too.
LAUNCH_STARTED_ENV = "TITAN_HYDRA_LAUNCH_STARTED"
_launches_ended: list[float] = []  # in the launcher: where its previous launch (an in-process sweep job) ended


def launch_started() -> float:
    """In a launcher: when this launch's start-up began (the process start, or the end of the
    process's previous launch)."""
    return max([process_start_time(), *_launches_ended])


def launch_ended() -> None:
    _launches_ended[:] = [time.time()]


def launcher_started() -> float | None:
    """In a worker: when the launcher that started it began (None: no local launcher, or unreadable)."""
    try:
        return float(os.environ[LAUNCH_STARTED_ENV])
    except (KeyError, ValueError):
        return None


def parse_line(line: str, number: int) -> dict[str, Any]:
    """One record, checked; LedgerCorrupt naming the line when it is not one."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise LedgerCorrupt(f"line {number} is not JSON ({e.msg})") from None
    kind = record.get("kind") if isinstance(record, dict) else None
    if kind not in ("start", "step", "end", "restarted"):
        raise LedgerCorrupt(f"line {number} is not a ledger record (kind {kind!r})")
    seconds = record.get("s", {})
    if not isinstance(seconds, dict) or any(c not in CATEGORIES or not isinstance(v, (int, float))
                                            for c, v in seconds.items()):
        raise LedgerCorrupt(f"line {number} has seconds of unknown categories: {seconds!r}")
    if kind == "step" and not isinstance(record.get("step"), int):
        raise LedgerCorrupt(f"line {number} is a step record without a step number")
    return record


def read_records(path: str | os.PathLike) -> tuple[list[dict[str, Any]], str | None]:
    """(records, problem) of the ledger since its last restart marker (the marker included).
    ``problem`` is None, or what is wrong with the first bad line after that marker (the records
    then stop there); bad lines before a marker are what the marker restarted after."""
    path = Path(path)
    if not path.exists():
        return [], None
    records: list[dict[str, Any]] = []
    problem = None
    with path.open(encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = parse_line(line, number)
            except LedgerCorrupt as e:
                problem = problem or str(e)
                continue
            if record["kind"] == "restarted":
                records, problem = [], None
            if problem is None:
                records.append(record)
    return records, problem


@dataclass
class Tally:
    """Seconds by category over a ledger's records, with restarts and rollbacks applied; fed one
    record at a time (``add``), by the live ledger and by readers of the file alike.
    ``keep_timeline`` keeps each record's final categories (a figure needs them; a run does not)."""

    keep_timeline: bool = False
    totals: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    lost_steps: int = 0
    rolled_back_steps: int = 0
    restarts: int = 0  # attempts that followed one which died
    attempts: list[dict[str, Any]] = field(default_factory=list)  # t, resumed_step, after_failure
    ended: bool = True  # the last attempt wrote its end record (a new one is not a restart)
    _fresh: bool = False  # a later attempt has not kept a step yet
    last_t: float = 0.0  # the Unix time of the last step or end record (0: none)
    # kept step records that a later restart or rollback may still move: [step, {cat: s}, timeline row]
    _alive: list[list[Any]] = field(default_factory=list)
    timeline: list[dict[str, Any]] = field(default_factory=list)  # t, attempt, s (final categories)

    def add(self, record: dict[str, Any]) -> None:
        kind = record["kind"]
        if kind == "restarted":
            self.__init__(keep_timeline=self.keep_timeline)  # the ledger starts over from here
            return
        if kind == "start":
            after_failure = bool(self.attempts) and not self.ended
            self.restarts += after_failure
            self.attempts.append({"t": float(record["t"]), "resumed_step": int(record.get("resumed_step", 0)),
                                  "after_failure": after_failure})
            self.ended = False
            self._fresh = len(self.attempts) > 1
        elif kind == "step" and self._fresh:
            # an attempt's first kept step says where it really continued (a checkpoint's step + 1, or a
            # torchft peer's step after healing): the earlier attempts' steps from there on were lost
            self._fresh = False
            self._rewind(record["step"] - 1, "lost")
        elif kind == "step" and self._alive and record["step"] <= self._alive[-1][0]:
            self._rewind(record["step"] - 1, "health")  # a rollback: the same steps again
        seconds = {c: float(v) for c, v in record.get("s", {}).items()}
        for c, v in seconds.items():
            self.totals[c] += v
        self.last_t = float(record["t"]) if kind != "start" else self.last_t
        row = None
        if self.keep_timeline:
            row = {"t": float(record["t"]), "attempt": len(self.attempts) - 1, "s": dict(seconds)}
            self.timeline.append(row)
        if kind == "step":
            self._alive.append([record["step"], seconds, row])
        elif kind == "end":
            self.ended = True

    def _rewind(self, to_step: int, into: str) -> None:
        """Kept steps after ``to_step`` were not kept after all: their seconds move to ``into``."""
        while self._alive and self._alive[-1][0] > to_step:
            _, seconds, row = self._alive.pop()
            total = sum(seconds.values())
            for c, v in seconds.items():
                self.totals[c] -= v
            self.totals[into] += total
            if row is not None:
                row["s"] = {into: total}
            if into == "lost":
                self.lost_steps += 1
            else:
                self.rolled_back_steps += 1

    @property
    def total_s(self) -> float:
        return sum(self.totals.values())

    @property
    def goodput(self) -> float:
        total = self.total_s
        return self.totals["productive"] / total if total > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        """The contract of ``recipes/goodput.py --json``."""
        return {"total_s": self.total_s, "productive_s": self.totals["productive"], "goodput": self.goodput,
                "lost_steps": self.lost_steps, "restarts": self.restarts, "categories": dict(self.totals),
                "attempts": len(self.attempts), "rolled_back_steps": self.rolled_back_steps}

    def metrics(self) -> dict[str, float]:
        """``goodput/*`` for the metric loggers."""
        out = {"goodput/goodput": self.goodput, "goodput/total_s": self.total_s,
               "goodput/lost_steps": float(self.lost_steps), "goodput/restarts": float(self.restarts)}
        out.update({f"goodput/{c}_s": v for c, v in self.totals.items()})
        return out


def tally_of(records: list[dict[str, Any]], keep_timeline: bool = False) -> Tally:
    tally = Tally(keep_timeline=keep_timeline)
    for record in records:
        tally.add(record)
    return tally


def format_ledger(summary: dict[str, Any], where: str = "") -> str:
    """The ledger as a table: seconds and share of the wall time by category."""
    total = summary["total_s"]
    attempts = summary.get("attempts", 0)
    head = (f"goodput {100 * summary['goodput']:.1f}% of {total:.1f} s wall{where}: {attempts} attempt(s), "
            f"{summary['restarts']} restart(s) after a failure, {summary['lost_steps']} step(s) trained twice")
    rows = [f"  {c:<15} {s:>10.2f} s {100 * s / total if total else 0.0:>6.1f}%  {CATEGORIES[c]}"
            for c, s in summary["categories"].items() if s or c in ("productive", "lost")]
    return "\n".join([head, *rows])


def footer_line(summary: dict[str, Any]) -> str:
    """The end summary's row: goodput and the categories that took time, largest first."""
    total = summary["total_s"]
    parts = sorted(((s, c) for c, s in summary["categories"].items() if s > 0.0005 * total), reverse=True)
    by = ", ".join(f"{c} {s:.1f} s" for s, c in parts)
    restarts = f"; {summary['restarts']} restart(s), {summary['lost_steps']} step(s) trained twice" \
        if summary["restarts"] else ""
    return f"{100 * summary['goodput']:.1f}% of {total:.1f} s ({by}){restarts}"
