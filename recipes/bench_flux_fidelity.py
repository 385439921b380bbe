"""The debug text-to-image recipe as a benchmark row: train ``experiment=flux_debug`` on this
machine, time it, and report the held-out caption fidelity it reached. Prints a markdown table
and writes JSON.

    python recipes/bench_flux_fidelity.py --threads 2 --out bench_out/flux_fidelity.json \\
        [--grid docs/images/flux_debug_grid.png] [-- training.steps=1000 ...]

The run is ``python launch.py experiment=flux_debug`` with ``cluster.threads_per_proc`` set and
any overrides after ``--``; its fidelity is the last ``val/fidelity/*`` it logged (``eval=fidelity``:
one picture per held-out caption, read back against the shapes grammar). The wall time is the
whole command's (encoding the set, training, validation, the fidelity evaluations, checkpoints).
``--grid`` then draws the README's labelled grid from the final checkpoint
(``recipes/flux_fidelity.py``).
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from titan_hydra.analysis.fidelity import last_fidelity, row_table, score, summary
from titan_hydra.analysis.flags import add_out, add_threads, parser
from titan_hydra.data.shapes_reader import CHANCE
from titan_hydra.hardware import cpu_model

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    add_threads(p, default=2)
    add_out(p, "JSON path", default="bench_out/flux_fidelity.json")
    p.add_argument("--run-dir", help="where the run writes (default: a temporary directory)")
    p.add_argument("--grid", help="also write the labelled grid of the final checkpoint here")
    p.add_argument("overrides", nargs="*", help="launch.py overrides (after --)")
    a = p.parse_args(argv)
    run_dir = Path(a.run_dir or tempfile.mkdtemp(prefix="flux_fidelity_")) / "run"
    command = [sys.executable, str(REPO / "launch.py"), "experiment=flux_debug", "logger=minimal",
               f"cluster.threads_per_proc={a.threads}", *a.overrides, f"hydra.run.dir={run_dir}"]
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        print(proc.stderr[-3000:], file=sys.stderr)
        return proc.returncode
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    step, fidelity = last_fidelity(metrics)
    result = {"date": datetime.date.today().isoformat(), "cpu": cpu_model(), "threads": a.threads, "steps": step,
              "wall_s": round(wall, 1), "overrides": a.overrides, "fidelity": fidelity, "chance": CHANCE}
    print(row_table(result))
    print(f"run: {run_dir}")
    if a.grid:  # what recipes/flux_fidelity.py <run> --grid <png> --json <run>/fidelity.json prints and writes
        scored = score(run_dir, grid=a.grid)
        (run_dir / "fidelity.json").write_text(json.dumps(scored, indent=1) + "\n")
        print(summary(scored))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
