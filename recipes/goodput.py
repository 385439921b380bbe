"""Where a run's wall time went: its goodput ledger (``<run dir>/goodput.jsonl``), finished or running.

    python recipes/goodput.py <run dir>                          # the table: seconds and share by category
    python recipes/goodput.py <run dir> --json                   # total_s, productive_s, goodput, lost_steps, restarts, categories
    python recipes/goodput.py <run dir> --plot goodput.png       # also the figure: time by category, restarts marked

Goodput is productive / total wall: the compute of the steps that were kept, over every second
of every attempt of the run (kill -9 and rerun, a SLURM requeue: the ledger continues across
them). The categories are those of titan_hydra/metrics/goodput.py; steps trained twice after a
restart, and each restart's start-up, are ``lost``. Bad input (no ledger, a corrupt one) is one line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from titan_hydra.errors import UserError, exit_status
from titan_hydra.metrics.goodput import CATEGORIES, LEDGER, Tally, format_ledger, read_records, tally_of


def ledger_of(run_dir: Path) -> Tally:
    """The run's ledger, tallied; a missing or corrupt one is a UserError (one line)."""
    path = Path(run_dir) / LEDGER
    if not path.is_file():
        raise UserError(f"{run_dir} has no {LEDGER} (give the run dir of a run started by launch.py)")
    records, problem = read_records(path)
    if problem is not None:
        raise UserError(f"{path} is corrupt ({problem}); the run restarts its ledger at its next start")
    return tally_of(records, keep_timeline=True)


def plot_goodput(tally: Tally, path: Path) -> Path:
    """Cumulative seconds by category against the ledger's wall time, one band per category, and a
    dashed line where an attempt started after a failure. (This recipe's one figure function.)"""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = [c for c in CATEGORIES if tally.totals[c] > 0]
    xs, bands, restarts = [0.0], {c: [0.0] for c in cats}, []
    for i, row in enumerate(tally.timeline):
        attempt = row["attempt"]
        if tally.attempts[attempt]["after_failure"] and (i == 0 or tally.timeline[i - 1]["attempt"] != attempt):
            restarts.append(xs[-1])
        xs.append(xs[-1] + sum(row["s"].values()))
        for c in cats:
            bands[c].append(bands[c][-1] + row["s"].get(c, 0.0))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.stackplot(xs, [bands[c] for c in cats], labels=cats)
    for i, x in enumerate(restarts):
        ax.axvline(x, color="k", linestyle="--", linewidth=1, label="restart" if i == 0 else None)
    ax.set_xlabel("wall time of the run's attempts, one after another (s)")
    ax.set_ylabel("cumulative seconds by category")
    ax.set_title(f"goodput {100 * tally.goodput:.1f}% ({tally.restarts} restart(s), "
                 f"{tally.lost_steps} step(s) trained twice)")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def report(run_dir: Path, as_json: bool, plot: Path | None) -> str:
    tally = ledger_of(run_dir)
    if plot is not None:
        plot_goodput(tally, plot)
    summary = tally.summary()
    if as_json:
        return json.dumps(summary, indent=2)
    return format_ledger(summary, where=f" in {run_dir}") + (f"\nfigure: {plot}" if plot else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path, help="the run dir (it holds goodput.jsonl)")
    p.add_argument("--json", action="store_true", help="the summary as JSON")
    p.add_argument("--plot", type=Path, default=None, help="write the figure (PNG) here")
    a = p.parse_args(argv)
    return exit_status(lambda: report(a.run_dir, a.json, a.plot))


if __name__ == "__main__":
    sys.exit(main())
