"""Score a Flux checkpoint's caption fidelity: does it draw what held-out captions say?

    python recipes/flux_fidelity.py outputs/<run> [--prompts 64] [--steps 20] [--guidance 3] [--seed 0]
        [--shift 1.0] [--holdout 0.1] [--json fidelity.json] [--grid grid.png --grid-prompts 4 --per-prompt 4]

One picture per held-out caption of the shapes grammar (captions a set drawn with ``data.holdout``
never shows), drawn by the run's sampler with fixed noise and read back by the shapes' own
geometry (``titan_hydra/data/shapes_reader.py``), as ``eval=fidelity`` does during training. It
prints a table (each rate beside chance) and writes the JSON; ``--grid`` also writes a PNG of the
first ``--grid-prompts`` captions, ``--per-prompt`` pictures each, every caption printed under its
row and the rates beside the grid. Sampler settings default to the run's ``eval.sample_*``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from titan_hydra.analysis.fidelity import score, summary
from titan_hydra.analysis.flags import parser
from titan_hydra.errors import exit_status


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("run", help="run directory or checkpoint/step-N directory")
    p.add_argument("--prompts", type=int, default=64, help="held-out captions scored (at most all of them)")
    p.add_argument("--steps", type=int, help="sampler steps (default: the run's eval.sample_steps)")
    p.add_argument("--guidance", type=float, help="guidance scale (default: the run's eval.sample_guidance)")
    p.add_argument("--seed", type=int, help="the noise (default: the run's eval.sample_seed)")
    p.add_argument("--shift", type=float, help="the sampler's timestep shift (default: the run's)")
    p.add_argument("--holdout", type=float, help="held-out fraction (default: the run's data.holdout)")
    p.add_argument("--json", help="write the rates here")
    p.add_argument("--grid", help="write a labelled PNG grid here")
    p.add_argument("--grid-prompts", type=int, default=4)
    p.add_argument("--per-prompt", type=int, default=4)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)

    def report() -> str:
        result = score(a.run, a.prompts, a.steps, a.guidance, a.seed, a.shift, a.holdout, a.grid, a.grid_prompts,
                       a.per_prompt)
        if a.json:
            Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
        return summary(result)

    return exit_status(report)


if __name__ == "__main__":
    sys.exit(main())
