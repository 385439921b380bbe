"""``${th_dirichlet:${data.draw},${data.draw_alpha}}``: a source's weight drawn from a Dirichlet.

Why a resolver: a mixture search (``experiment=mixture_search``) is a plain Hydra sweep over
``data.draw=0,...,N-1``; each job turns its draw number into weights while its config composes.
The weights then depend only on (draw, alpha, the names of the sources), so a SLURM array task, a
requeued job and a resumed run all compose the same mixture, and the resolved weights stand in the
job's config (its W&B config, and ``.hydra/config.yaml`` resolved) where ``recipes/mixture_law.py``
reads them back. The sources are the siblings of the node holding the weight (``data.sources``),
so a source added on the command line joins the draw without listing the names twice.
"""

from __future__ import annotations

import numpy as np
from omegaconf import DictConfig

DRAW_SALT = 55  # separates these draws from any other stream seeded with small integers
DIGITS = 4  # weights are printed and stored rounded: a config a person can read and paste


def dirichlet_weights(draw: int, alpha: float, count: int) -> np.ndarray:
    """``count`` proportions drawn from Dirichlet(alpha, ..., alpha) by draw number ``draw``,
    rounded to DIGITS decimals (the rounding error is < 1e-4 per source; proportions are
    renormalized by the loader anyway)."""
    if count < 1 or alpha <= 0:
        raise ValueError(f"a Dirichlet draw needs >= 1 source and alpha > 0 (got {count} sources, alpha={alpha})")
    w = np.random.default_rng([DRAW_SALT, int(draw)]).dirichlet(np.full(count, float(alpha)))
    return np.round(w, DIGITS)


def dirichlet_weight(draw, alpha, *, _parent_: DictConfig) -> float:
    """The resolver: the weight of the source whose node holds this interpolation."""
    sources = _parent_._get_parent()
    names = list(sources.keys())
    return float(dirichlet_weights(int(draw), float(alpha), len(names))[names.index(_parent_._key())])
