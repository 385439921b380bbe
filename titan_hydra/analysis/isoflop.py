"""IsoFLOP minima: per FLOP budget, the model size that reaches the lowest loss, and how it grows.

Hoffmann et al. (2022)'s IsoFLOP profiles: at a fixed budget C, the final loss against log N is
close to a parabola whose vertex is the compute-optimal size; over several budgets the vertices give
``N_opt ~ C^a`` and ``D_opt ~ C^b``. A fit of its own beside ``scaling_law.fit_law``: no functional
form for L(N, D) is assumed, so the two estimates of the exponent check each other.

A ladder of sizes x token budgets puts no two runs on one budget; each size's loss at budget C is
read off its own runs, linearly in (log C, log L) between the two runs that bracket C (never
extrapolated). Numbers only, like scaling_law.py.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

MIN_SIZES = 3  # a parabola through fewer sizes has no error to speak of


@dataclass(frozen=True)
class Profile:
    """One budget: the sizes that reach it, their (interpolated) losses and tokens, the vertex."""

    flops: float
    n: list[float]
    d: list[float]
    loss: list[float]
    n_opt: float | None  # None: the parabola opens downwards or its vertex lies outside the sizes
    d_opt: float | None
    loss_opt: float | None


@dataclass(frozen=True)
class IsoFlop:
    profiles: list[Profile]
    a: float | None  # N_opt ~ C^a
    b: float | None  # D_opt ~ C^b
    log_n_coef: tuple[float, float] | None  # (slope, intercept) of log N_opt vs log C
    log_d_coef: tuple[float, float] | None

    def as_dict(self) -> dict:
        return asdict(self)


def _by_size(n, d, flops, loss) -> dict[float, np.ndarray]:
    """{size: rows of (log C, log D, log L) sorted by C}."""
    out = {}
    for size in np.unique(n):
        rows = np.stack([np.log(flops[n == size]), np.log(d[n == size]), np.log(loss[n == size])], axis=1)
        out[float(size)] = rows[np.argsort(rows[:, 0])]
    return out


def default_budgets(runs: dict[float, np.ndarray], count: int = 5) -> np.ndarray:
    """``count`` budgets, evenly spaced in log C, over the range that ``MIN_SIZES`` sizes reach."""
    lo = min(r[0, 0] for r in runs.values())
    hi = max(r[-1, 0] for r in runs.values())
    grid = np.linspace(lo, hi, 200)
    reached = [c for c in grid if sum(r[0, 0] <= c <= r[-1, 0] for r in runs.values()) >= MIN_SIZES]
    if not reached:
        return np.array([])
    return np.exp(np.linspace(min(reached), max(reached), count))


def profile(runs: dict[float, np.ndarray], flops: float) -> Profile:
    """The sizes that reach ``flops``, their loss there, and the vertex of loss vs log N."""
    c = np.log(flops)
    sizes = [s for s, r in runs.items() if r[0, 0] <= c <= r[-1, 0]]
    log_d = [float(np.interp(c, runs[s][:, 0], runs[s][:, 1])) for s in sizes]
    loss = [float(np.exp(np.interp(c, runs[s][:, 0], runs[s][:, 2]))) for s in sizes]
    n_opt = d_opt = loss_opt = None
    if len(sizes) >= MIN_SIZES:
        x = np.log(sizes)
        p2, p1, p0 = np.polyfit(x, loss, 2)
        vertex = -p1 / (2 * p2) if p2 > 0 else None
        if vertex is not None and x.min() <= vertex <= x.max():
            n_opt, loss_opt = float(np.exp(vertex)), float(p0 + p1 * vertex + p2 * vertex**2)
            d_opt = float(np.exp(np.interp(vertex, x, log_d)))
    return Profile(float(flops), [float(s) for s in sizes], [float(np.exp(v)) for v in log_d], loss,
                   n_opt, d_opt, loss_opt)


def isoflop_minima(n, d, flops, loss, budgets=None) -> IsoFlop:
    """Profiles at ``budgets`` (default: ``default_budgets``) and the power laws through their
    vertices (None where fewer than two budgets have one)."""
    n, d, flops, loss = (np.asarray(x, dtype=float) for x in (n, d, flops, loss))
    runs = _by_size(n, d, flops, loss)
    budgets = default_budgets(runs) if budgets is None else np.asarray(budgets, dtype=float)
    profiles = [profile(runs, float(c)) for c in budgets]
    found = [p for p in profiles if p.n_opt is not None]
    if len(found) < 2:
        return IsoFlop(profiles, None, None, None, None)
    log_c = np.log([p.flops for p in found])
    a, a0 = np.polyfit(log_c, np.log([p.n_opt for p in found]), 1)
    b, b0 = np.polyfit(log_c, np.log([p.d_opt for p in found]), 1)
    return IsoFlop(profiles, float(a), float(b), (float(a), float(a0)), (float(b), float(b0)))
