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

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "recipes"))

from bench_gdn import cpu_name  # noqa: E402
from titan_hydra.data.shapes_reader import CHANCE, METRICS  # noqa: E402

TARGET = 0.8  # the bar: background right and the shape's colour at its named place


def last_fidelity(metrics: list[dict]) -> tuple[int, dict[str, float]]:
    """(step, {what: fraction}) of the last row that logged ``val/fidelity/*``."""
    rows = [r for r in metrics if any(k.startswith("val/fidelity/") for k in r)]
    if not rows:
        raise RuntimeError("the run logged no val/fidelity/* (eval=fidelity and data.holdout > 0 are needed)")
    last = rows[-1]
    return int(last["step"]), {k.split("/", 2)[2]: float(v) for k, v in last.items() if k.startswith("val/fidelity/")}


def row_table(result: dict) -> str:
    f = result["fidelity"]
    head = "| CPU | threads | steps | wall (s) | " + " | ".join(METRICS) + " | >= 80% |"
    rule = "|---|---:|---:|---:|" + "---:|" * len(METRICS) + "---|"
    cells = " | ".join(f"{f[k]:.0%}" for k in METRICS)
    chance = " | ".join(f"{CHANCE[k]:.0%}" for k in METRICS)
    ok = "yes" if f["background_and_colour"] >= TARGET else "no"
    return "\n".join([head, rule, f"| {result['cpu']} | {result['threads']} | {result['steps']} | "
                      f"{result['wall_s']:.0f} | {cells} | {ok} |", f"| chance | | | | {chance} | |"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="bench_out/flux_fidelity.json")
    p.add_argument("--run-dir", help="where the run writes (default: a temporary directory)")
    p.add_argument("--grid", help="also write the labelled grid of the final checkpoint here")
    p.add_argument("overrides", nargs="*", help="launch.py overrides (after --)")
    a = p.parse_args(argv)
    run_dir = Path(a.run_dir or tempfile.mkdtemp(prefix="flux_fidelity_")) / "run"
    command = [sys.executable, str(ROOT / "launch.py"), "experiment=flux_debug", "logger=minimal",
               f"cluster.threads_per_proc={a.threads}", *a.overrides, f"hydra.run.dir={run_dir}"]
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        print(proc.stderr[-3000:], file=sys.stderr)
        return proc.returncode
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    step, fidelity = last_fidelity(metrics)
    result = {"date": datetime.date.today().isoformat(), "cpu": cpu_name(), "threads": a.threads, "steps": step,
              "wall_s": round(wall, 1), "overrides": a.overrides, "fidelity": fidelity, "chance": CHANCE}
    print(row_table(result))
    print(f"run: {run_dir}")
    if a.grid:
        from flux_fidelity import main as fidelity_main

        fidelity_main([str(run_dir), "--grid", a.grid, "--json", str(run_dir / "fidelity.json")])
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
