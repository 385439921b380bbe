"""Summarize a multirun sweep: one row per job, loss curves and throughput plots.

    python recipes/sweep_report.py multirun/2025-01-31/12-00-00

Writes into that dir: ``report.md`` and ``report.csv`` (overrides, final loss, validation loss,
tok/s, MFU, peak memory, status) and ``loss_curves.png`` / ``throughput.png``; a sweep over a data
mixture's weights adds each source's validation loss (``val/<name>/loss``) as columns and as
``source_val_curves.png``. A sweep over ``optimizer.lr`` and other keys (e.g.
``experiment=mup_transfer``: widths x learning rates) adds the loss against the LR, one curve per
value of the other keys, with each curve's best LR: a table and ``loss_vs_lr.png``. A run that
scores its pictures (``eval=fidelity``) adds each ``val/fidelity/<what>`` (fraction of held-out
captions drawn right) as columns and as ``fidelity_curves.png``. A sweep of cooldown branches
(``experiment=anneal_branches``: ``lr_scheduler=cooldown`` jobs started from a stable run's
checkpoints) adds ``anneal_branches.png``: validation loss against tokens, the stable run's curve
with each branch leaving it. A sweep of dry runs (``-m dry_run=simulate`` or ``dry_run=true``) gets
one row per layout instead: peak memory per rank beside the planner's, fits, collective bytes per
mesh dim, estimated tokens/s, or the launch's refusal (titan_hydra/analysis/layout_sweep.py; such
a sweep writes it when it ends). The reading and writing is titan_hydra/analysis/sweep_report.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

from titan_hydra.analysis.flags import parser
from titan_hydra.analysis.sweep_report import report
from titan_hydra.errors import exit_status


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("sweep_dir", type=Path, help="a multirun dir (hydra.sweep.dir)")
    args = p.parse_args(argv)

    def summarize() -> str:
        report(args.sweep_dir)
        return (args.sweep_dir / "report.md").read_text()

    return exit_status(summarize)


if __name__ == "__main__":
    sys.exit(main())
