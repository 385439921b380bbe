"""Fit how each source's validation loss depends on the data mixture, and find the best mixture.

    python launch.py -m experiment=mixture_search hydra.sweep.dir=multirun/mixture_search
    python recipes/mixture_law.py multirun/mixture_search --target mean --bound docs=0.05:0.6

Reads every completed job of the multirun dir(s) (as recipes/sweep_report.py does): its mixture
from its own ``.hydra/config.yaml`` (the weights resolved, ``${th_dirichlet:}`` draws included,
as proportions) and its last ``val/<name>/loss`` per source. Fits per source a data mixing law
(titan_hydra/analysis/mixture_law.py: ``c + k exp(t . r)``, or Scheffe's quadratic regression where
that predicts left-out proxies better) with bootstrap intervals, reports each proxy's loss
predicted with that proxy left out, and finds the mixture minimising ``--target`` (``mean`` of all
sources' losses, one source, or ``name=w,...``) inside ``--bound name=low:high``. Prints it, the
uniform mixture and the natural one (each source's share of training tokens) as ``data.sources``
overrides to paste, and writes ``mixture_law.json`` and ``mixture_law.png`` into the first dir
(or ``--out``). ``--check <dir>`` (repeatable): runs of any mixture at another size or length
(e.g. the three printed mixtures at 4x the steps); each is predicted from the law plus the loss
shift the other check runs measured at that scale, beside what it measured.
"""

from __future__ import annotations

import sys
from pathlib import Path

from titan_hydra.analysis.flags import add_bootstrap, add_out, add_sweep_dirs, parser
from titan_hydra.analysis.mixture_report import fit_and_record, report, write
from titan_hydra.errors import exit_status


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    add_sweep_dirs(p, "multirun dir(s) of the proxies")
    p.add_argument("--target", default="mean", help="mean | <source> | <source>=<w>,<source>=<w>,...")
    p.add_argument("--bound", action="append", default=[], help="<source>=<low>:<high> on its proportion (repeatable)")
    p.add_argument("--form", choices=["auto", "exp", "scheffe"], default="auto", help="the law's form (auto: per "
                   "source, Scheffe's regression only where it predicts left-out proxies better)")
    add_bootstrap(p)
    p.add_argument("--check", type=Path, action="append", default=[],
                   help="a multirun dir of runs at another scale, predicted beside what they measured (repeatable)")
    add_out(p, "where mixture_law.json/.png go (default: the first dir)", path=True)
    a = p.parse_args(argv)

    def fit() -> str:
        law, record = fit_and_record(a.sweep_dirs, a.target, a.bound, a.form, a.resamples, a.level, a.check)
        wrote = write(record, law, a.out or a.sweep_dirs[0])
        return f"{report(record)}\n{wrote}"

    return exit_status(fit)


if __name__ == "__main__":
    sys.exit(main())
