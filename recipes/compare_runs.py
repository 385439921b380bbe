"""Where two runs part: per logged metric, the first step where they differ, and by how much.

    python recipes/compare_runs.py outputs/run_a outputs/run_b                 # within the default tolerance
    python recipes/compare_runs.py runs/single runs/fsdp2 --rtol 1e-4 --plot diff.png
    python recipes/compare_runs.py multirun/2025-01-31/12-00-00/0 multirun/2025-01-31/12-00-00/1 --exact

Each argument is a run dir or a multirun job dir (anything holding a ``metrics.jsonl``). For every
metric both runs logged (loss, grad_norm, lr, val/loss, ...; not the timing and memory ones, which
no two runs share) over the steps both logged (a resumed run's re-run steps: the last value wins),
it prints the first step where ``|a - b| > atol + rtol * |b|`` (numpy.isclose's rule; ``--exact``:
any difference at all, bit for bit, NaN equal to NaN), the largest absolute and relative
differences and their steps. The default tolerance, rtol 1e-5, is about 100 fp32 ulps: what
reordering the reductions of a small fp32 run moves a loss by (a layout change; see the parity
bounds of tests/helpers.py), far below any change of data, schedule or model. Runs that evaluated
during training (``eval.freq``, ``eval.suite``) add a table of each run's last score per task,
``eval/<task>/acc`` and ``eval/<task>/ppl``, and B - A. Exit status: 0 when every metric agrees,
1 when one differs, 2 for bad input (a missing dir, no metrics, nothing in common).
"""

from __future__ import annotations

import sys
from pathlib import Path

from titan_hydra.analysis.compare import ATOL, RTOL, KeyDiff, compare, eval_table, plot, table
from titan_hydra.analysis.flags import parser
from titan_hydra.errors import exit_status


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("run_a", type=Path)
    p.add_argument("run_b", type=Path)
    p.add_argument("--rtol", type=float, default=RTOL, help=f"relative tolerance (default {RTOL})")
    p.add_argument("--atol", type=float, default=ATOL, help=f"absolute tolerance (default {ATOL})")
    p.add_argument("--exact", action="store_true", help="bitwise: any difference counts")
    p.add_argument("--keys", default=None, help="comma-separated metrics (default: every shared one)")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG of the curves and differences")
    args = p.parse_args(argv)
    diffs: list[KeyDiff] = []

    def report() -> str:
        diffs.extend(compare(args.run_a, args.run_b, args.rtol, args.atol, args.exact,
                             args.keys.split(",") if args.keys else None))
        rule = "bitwise" if args.exact else f"|a - b| <= {args.atol:g} + {args.rtol:g} * |b|"
        if args.plot:
            plot(args.run_a, args.run_b, diffs, args.plot)
        differing = [d.key for d in diffs if d.first_step is not None]
        scores = eval_table(args.run_a, args.run_b)
        return (f"A: {args.run_a}\nB: {args.run_b}\ntolerance: {rule}\n\n{table(diffs)}\n\n"
                + (f"{scores}\n\n" if scores else "")
                + (f"differ: {', '.join(differing)}" if differing else "equal within the tolerance"))

    status = exit_status(report)
    return 1 if status == 0 and any(d.first_step is not None for d in diffs) else status


if __name__ == "__main__":
    sys.exit(main())
