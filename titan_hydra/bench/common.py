"""What every benchmark suite shares: running ``launch.py`` as a user types it, in its own process
and run dir, and turning what it wrote (metrics.jsonl, the run header on stdout) into table rows.

The suites run the checkout's own ``launch.py`` (``REPO``), with ``OMP_NUM_THREADS`` set to the
threads a variant asks for, one variant after another so their ratios are comparable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the checkout: its launch.py and recipes/


def run_dir_of(tmp: Path, name: str) -> Path:
    """A variant's run dir under ``tmp``: its name with every non-alphanumeric character as ``_``."""
    return tmp / "".join(c if c.isalnum() else "_" for c in name)


def launch(args: list[str], threads: int, cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    """``python launch.py ARGS`` with ``OMP_NUM_THREADS=threads`` in ``cwd``: (the process, wall seconds)."""
    t0 = time.time()
    proc = subprocess.run([sys.executable, str(REPO / "launch.py"), *args], capture_output=True, text=True, cwd=cwd,
                          env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    return proc, time.time() - t0


def failure(proc: subprocess.CompletedProcess) -> str:
    """The last line a failed run wrote on stderr."""
    return (proc.stderr.strip().splitlines() or ["?"])[-1]


def metrics_of(run_dir: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def header_value(stdout: str, row: str) -> str:
    """A row of the run header (``  precision  fp32 (auto: ...)``) from rank 0's output ('?' if absent)."""
    for line in stdout.splitlines():
        if line.startswith(f"  {row} "):
            return line[len(row) + 2:].strip()
    return "?"


def variant_table(title: str, columns: list[str], rows: list[dict], cells) -> list[str]:
    """A suite's markdown table: one row per variant, ``cells(row)`` for the columns, or the
    variant's failure line."""
    lines = [title, "", "| variant | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for r in rows:
        lines.append(f"| {r['variant']} | failed: {r['failed']} |" if "failed" in r
                     else f"| {r['variant']} | {cells(r)} |")
    return lines
