"""Scaling-law fits: the loss of a model of N parameters trained on D tokens, from a grid of small runs.

``fit_law`` fits ``L(N, D) = E + A/N^alpha + B/D^beta`` as Hoffmann et al. (2022) approach 3 with
Besiroglu et al. (2024)'s details: Huber loss (delta 1e-3) between log L and the model's log in
logsumexp form, L-BFGS started from the best points of a grid, bootstrap resampling of the runs
for confidence intervals. ``isoflop_minima`` finds, per FLOP budget, the loss-minimizing size from
a parabola in log N and fits ``N_opt ~ C^a``, ``D_opt ~ C^b`` (Hoffmann et al.'s IsoFLOP profiles).

In the analysis package because it fits finished sweeps (``scaling_report.py`` reads the runs);
``recipes/estimate.py --law`` reads the saved fit beside a plan. Numbers only (numpy, scipy):
nothing here knows about configs or run directories.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from scipy.optimize import minimize

from titan_hydra.errors import UserError

PARAMS = ("E", "A", "B", "alpha", "beta")
HUBER_DELTA = 1e-3
# Starting grid over (log E, log A, log B, alpha, beta), as in Hoffmann et al.; the best
# START_COUNT grid points (by objective) seed L-BFGS, the rest only cost one vectorized evaluation.
START_GRID = (np.arange(-1.0, 1.6, 0.5), np.arange(0.0, 26.0, 5.0), np.arange(0.0, 26.0, 5.0),
              np.arange(0.0, 2.1, 0.5), np.arange(0.0, 2.1, 0.5))
START_COUNT = 12
# A parameter is "not pinned" by the runs when its bootstrap interval spans more than this many
# decades: nine CPU runs leave A in [13, 1e44] while still predicting the next width within 1%.
PINNED_DECADES = 2.0
# Box for L-BFGS-B in (log E, log A, log B, alpha, beta): only to keep exp() and N^alpha finite when a
# fit drives E to 0 (nine CPU runs do) or a bootstrap resample of two sizes lets an exponent run off;
# E = exp(-20) is zero at any loss, and no fit of real runs is near the other edges.
BOUNDS = [(-20.0, 10.0), (-20.0, 200.0), (-20.0, 200.0), (0.0, 10.0), (0.0, 10.0)]


@dataclass(frozen=True)
class Law:
    """``L(N, D) = E + A/N^alpha + B/D^beta``."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float

    def loss(self, n, d):
        return self.E + self.A / np.power(n, self.alpha) + self.B / np.power(d, self.beta)

    def optimal(self, flops, flops_per_nd: float = 6.0) -> tuple[float, float]:
        """The (N, D) that minimize the loss at ``flops = flops_per_nd * N * D`` (closed form:
        Hoffmann et al. eq. 4)."""
        g = (self.alpha * self.A / (self.beta * self.B)) ** (1.0 / (self.alpha + self.beta))
        n = g * (flops / flops_per_nd) ** (self.beta / (self.alpha + self.beta))
        return n, flops / (flops_per_nd * n)

    @property
    def theta(self) -> np.ndarray:
        return np.array([np.log(self.E), np.log(self.A), np.log(self.B), self.alpha, self.beta])

    @classmethod
    def from_theta(cls, theta) -> Law:
        e, a, b, alpha, beta = (float(x) for x in theta)
        return cls(float(np.exp(e)), float(np.exp(a)), float(np.exp(b)), alpha, beta)


def _log_terms(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray) -> np.ndarray:
    """[log(A/N^alpha), log(B/D^beta), log E] per run (rows): the logsumexp form of the law."""
    e, a, b, alpha, beta = theta
    return np.stack([a - alpha * log_n, b - beta * log_d, np.full_like(log_n, e)], axis=-1)


def huber_objective(theta, log_n, log_d, log_loss, delta: float = HUBER_DELTA) -> tuple[float, np.ndarray]:
    """Sum of Huber(log L_model - log L) over the runs, divided by delta (the same minimizer, but
    gradients of order one, which L-BFGS's tolerances expect); and its gradient in theta."""
    terms = _log_terms(theta, log_n, log_d)
    top = terms.max(axis=-1, keepdims=True)  # logsumexp by hand: scipy's costs 10x more per call
    ex = np.exp(terms - top)
    total = ex.sum(axis=-1, keepdims=True)
    r = (top + np.log(total))[:, 0] - log_loss
    small = np.abs(r) <= delta
    value = np.where(small, 0.5 * r**2, delta * (np.abs(r) - 0.5 * delta)).sum() / delta
    dr = np.clip(r, -delta, delta) / delta  # dHuber/dr, scaled
    w = ex / total  # d logsumexp / d term (softmax)
    grad = np.array([(dr * w[:, 2]).sum(), (dr * w[:, 0]).sum(), (dr * w[:, 1]).sum(),
                     -(dr * w[:, 0] * log_n).sum(), -(dr * w[:, 1] * log_d).sum()])
    return float(value), grad


def _grid_starts(log_n, log_d, log_loss, count: int) -> np.ndarray:
    """The ``count`` grid points with the lowest objective (one vectorized pass over the grid)."""
    grid = np.array(list(itertools.product(*START_GRID)))
    e, a, b, alpha, beta = (grid[:, i:i + 1] for i in range(5))
    pred = np.logaddexp(np.logaddexp(a - alpha * log_n, b - beta * log_d), e)
    r = np.abs(pred - log_loss)
    value = np.where(r <= HUBER_DELTA, 0.5 * r**2, HUBER_DELTA * (r - 0.5 * HUBER_DELTA)).sum(axis=1)
    return grid[np.argsort(value)[:count]]


def _minimize(starts, log_n, log_d, log_loss) -> np.ndarray:
    best, best_value = None, np.inf
    for start in starts:
        res = minimize(huber_objective, start, args=(log_n, log_d, log_loss), jac=True, method="L-BFGS-B", bounds=BOUNDS,
                       options={"maxiter": 2000, "ftol": 1e-15, "gtol": 1e-10})
        if res.fun < best_value:
            best, best_value = res.x, res.fun
    return best


def check_points(n, d, loss) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n, d, loss = (np.asarray(x, dtype=float) for x in (n, d, loss))
    sizes, budgets = len(np.unique(n)), len(np.unique(d))
    if len(loss) < 6 or sizes < 2 or budgets < 2:
        raise UserError(f"a fit of E, A, B, alpha, beta needs at least 6 runs over 2 model sizes and 2 token "
                        f"budgets: found {len(loss)} runs, {sizes} size(s), {budgets} budget(s); sweep model.dim "
                        f"and training.steps (experiment=scaling_ladder)")
    if (n <= 0).any() or (d <= 0).any() or (loss <= 0).any():
        raise UserError("model sizes, token counts and losses must be positive")
    return n, d, loss


def fit_law(n, d, loss) -> Law:
    """The least-Huber law through the runs (N, D, final loss): L-BFGS from the best grid starts."""
    n, d, loss = check_points(n, d, loss)
    log_n, log_d, log_loss = np.log(n), np.log(d), np.log(loss)
    starts = _grid_starts(log_n, log_d, log_loss, START_COUNT)
    return Law.from_theta(_minimize(starts, log_n, log_d, log_loss))


@dataclass
class Fit:
    """A law, its bootstrap resamples (one Law per resample) and the confidence level."""

    law: Law
    samples: list[Law] = field(default_factory=list)
    level: float = 0.95

    def interval(self, values: np.ndarray) -> tuple[float, float]:
        tail = 100 * (1 - self.level) / 2
        lo, hi = np.percentile(values, [tail, 100 - tail])
        return float(lo), float(hi)

    def param_intervals(self) -> dict[str, tuple[float, float]]:
        return {p: self.interval(np.array([getattr(s, p) for s in self.samples])) for p in PARAMS}

    def not_pinned(self) -> list[str]:
        """The parameters whose interval spans more than PINNED_DECADES decades (or reaches 0)."""
        if not self.samples:
            return []
        return [p for p, (lo, hi) in self.param_intervals().items()
                if lo <= 0 or np.log10(hi / lo) > PINNED_DECADES]

    def predict(self, n: float, d: float) -> tuple[float, float, float]:
        """(loss, low, high) of a run of N parameters and D tokens."""
        return float(self.law.loss(n, d)), *self.interval(np.array([s.loss(n, d) for s in self.samples]))

    def optimal(self, flops: float, flops_per_nd: float) -> dict[str, float | list[float]]:
        n, d = self.law.optimal(flops, flops_per_nd)
        ns, ds = zip(*(s.optimal(flops, flops_per_nd) for s in self.samples))
        loss = self.predict(n, d)
        return {"flops": flops, "n": n, "d": d, "n_interval": list(self.interval(np.array(ns))),
                "d_interval": list(self.interval(np.array(ds))), "loss": loss[0], "loss_interval": list(loss[1:])}

    def as_dict(self) -> dict:
        return {"law": asdict(self.law), "level": self.level, "intervals": self.param_intervals(),
                "bootstrap": [[getattr(s, p) for p in PARAMS] for s in self.samples]}

    @classmethod
    def from_dict(cls, data: dict) -> Fit:
        samples = [Law(*row) for row in data.get("bootstrap", [])]
        return cls(Law(**data["law"]), samples, float(data.get("level", 0.95)))


def bootstrap_fit(n, d, loss, resamples: int = 200, level: float = 0.95, seed: int = 0) -> Fit:
    """``fit_law`` on the runs, and again on ``resamples`` resamples of them (with replacement),
    each started from the full fit and from its own best grid point: from the full fit alone, a
    parameter the full fit drove to a bound (E -> 0: its gradient vanishes) could never move."""
    n, d, loss = check_points(n, d, loss)
    law = fit_law(n, d, loss)
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(resamples):
        idx = rng.integers(0, len(loss), len(loss))
        log_n, log_d, log_loss = np.log(n[idx]), np.log(d[idx]), np.log(loss[idx])
        starts = np.vstack([law.theta[None], _grid_starts(log_n, log_d, log_loss, 1)])
        samples.append(Law.from_theta(_minimize(starts, log_n, log_d, log_loss)))
    return Fit(law, samples, level)


def load_fit(path: str | Path) -> tuple[Fit, dict]:
    """A fit JSON that ``recipes/scaling_law.py`` wrote: the Fit, and the whole record."""
    try:
        data = json.loads(Path(path).read_text())
        return Fit.from_dict(data["fit"]), data
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"--law {path}: not a fit that recipes/scaling_law.py wrote ({e})") from e
