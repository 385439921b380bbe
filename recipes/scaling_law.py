"""Fit a scaling law to a multirun of model sizes x token budgets, and say what a bigger budget buys.

    python launch.py -m experiment=scaling_ladder
    python recipes/scaling_law.py multirun/<date>/<time> --flops 1e15

Reads every completed job of the multirun dir(s) (as recipes/sweep_report.py does), sizes each from
its own ``.hydra/config.yaml`` with the planner: N = parameters (``--params non_embedding``: all
but the input embedding table, whose lookup costs no FLOPs; ``total``), D = tokens seen (the
tokens per step the run logged, summed over its steps), C = the planner's FLOPs per token x D; and
its loss (``--loss val``: the last validation loss; ``train``: the mean training loss over the last
tenth of the steps). Then fits ``L(N, D) = E + A/N^alpha + B/D^beta`` with bootstrap intervals and
the IsoFLOP minima (titan_hydra/analysis/scaling_law.py, isoflop.py, scaling_report.py), prints
both and the compute-optimal N and D of each ``--flops`` budget, and writes ``scaling_law.json``
(the fit ``recipes/estimate.py --law`` reads) and ``scaling_law.png`` (IsoFLOP profiles, loss
against tokens per size, N_opt against C) into the first dir, or ``--out``. ``--holdout <dir>``:
runs predicted rather than fitted, the prediction (and interval) beside the measured loss.
"""

from __future__ import annotations

import sys
from pathlib import Path

from titan_hydra.analysis.flags import add_bootstrap, add_out, add_sweep_dirs, parser
from titan_hydra.analysis.scaling_report import fit_sweeps, report, write
from titan_hydra.errors import exit_status


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    add_sweep_dirs(p)
    p.add_argument("--flops", type=float, action="append", default=[], help="a compute budget (repeatable)")
    p.add_argument("--loss", choices=["val", "train"], default="val")
    p.add_argument("--params", choices=["non_embedding", "total"], default="non_embedding")
    add_bootstrap(p)
    p.add_argument("--holdout", type=Path, action="append", default=[],
                   help="a multirun dir whose runs are predicted, not fitted (repeatable)")
    add_out(p, "where scaling_law.json/.png go (default: the first dir)", path=True)
    a = p.parse_args(argv)

    def fit() -> str:
        record, law = fit_sweeps(a.sweep_dirs, a.loss, a.params, a.resamples, a.level, a.flops, a.holdout)
        wrote = write(record, law, a.out or a.sweep_dirs[0])
        return f"{report(record, law)}\n{wrote}"

    return exit_status(fit)


if __name__ == "__main__":
    sys.exit(main())
