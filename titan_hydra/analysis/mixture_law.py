"""Data mixing laws: each source's validation loss as a function of the mixture's proportions.

Fitted per validation source from small proxy runs whose weights were drawn at random
(``experiment=mixture_search``), two forms:

* ``exp``: ``L(r) = c + k * exp(sum_j t_j r_j)`` (Ye et al. 2024, data mixing laws). Proportions
  sum to one, so adding a constant to every ``t_j`` and dividing ``k`` by its exponential is the
  same law: the fit reports the one with ``sum_j t_j = 0`` (then ``c + k`` is the loss at the
  uniform mixture), the only version whose parameters a fit can pin.
* ``scheffe``: Scheffe's quadratic mixture polynomial ``sum_j b_j r_j + sum_{j<l} b_jl r_j r_l``,
  a linear regression over the proportions in the spirit of RegMix (Liu et al. 2024); used for a
  source only where it predicts the proxies left out of the fit better than ``exp``.

Intervals come from bootstrap resamples of the proxies (the same resample for every source, so a
target that weighs several sources combines them sample by sample). ``optimal_mixture`` finds the
proportions that minimise a weighted sum of the sources' losses under per-source bounds.
Numbers only (numpy, scipy); ``recipes/mixture_law.py`` reads the runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import combinations

import numpy as np
from scipy.optimize import least_squares, minimize

from titan_hydra.errors import UserError

# A parameter is "not pinned" when its interval lets the term it scales change by more than this
# factor: a positive parameter whose interval spans two decades, a log-scale one (t) spanning ln 100.
PINNED_RATIO = 100.0
MIN_PROXIES = 2  # below this nothing is left out to check a fit on; the report says what 2-3 runs cannot pin


class ExpForm:
    """``c + k * exp(t . r)`` with ``sum(t) = 0``; theta = (c, k, t_1..t_K)."""

    name = "exp"

    def param_names(self, sources: list[str]) -> list[str]:
        return ["c", "k"] + [f"t[{s}]" for s in sources]

    def predict(self, theta: np.ndarray, r: np.ndarray) -> np.ndarray:
        return theta[0] + theta[1] * np.exp(r @ theta[2:])

    def fit(self, r: np.ndarray, y: np.ndarray, start: np.ndarray | None = None) -> np.ndarray:
        """Least squares in relative error, from a few values of c (and ``start``, a previous fit)."""
        top = float(y.min()) * (1 - 1e-9)

        def resid(x):
            t = np.append(x[2:], -x[2:].sum())
            return (x[0] + np.exp(x[1] + r @ t)) / y - 1

        k = r.shape[1]
        starts = [np.concatenate([[c0, np.log(max(y.mean() - c0, 1e-6))], np.zeros(k - 1)])
                  for c0 in (0.0, 0.5 * top, 0.9 * top)]
        if start is not None:
            starts.insert(0, np.concatenate([[min(start[0], 0.99 * top), np.log(start[1])], start[2:-1]]))
        lo = np.concatenate([[0.0, -30.0], np.full(k - 1, -50.0)])
        hi = np.concatenate([[top, 10.0], np.full(k - 1, 50.0)])
        best = min((least_squares(resid, np.clip(x0, lo + 1e-12, hi - 1e-12), bounds=(lo, hi), xtol=1e-12,
                                  ftol=1e-12) for x0 in starts), key=lambda res: res.cost)
        x = best.x
        return np.concatenate([[x[0], np.exp(x[1])], x[2:], [-x[2:].sum()]])


class ScheffeForm:
    """``sum_j b_j r_j + sum_{j<l} b_jl r_j r_l`` by least squares; theta = the b's."""

    name = "scheffe"

    def param_names(self, sources: list[str]) -> list[str]:
        return [f"b[{s}]" for s in sources] + [f"b[{a}*{b}]" for a, b in combinations(sources, 2)]

    @staticmethod
    def features(r: np.ndarray) -> np.ndarray:
        return np.concatenate([r] + [r[..., [a]] * r[..., [b]] for a, b in combinations(range(r.shape[-1]), 2)],
                              axis=-1)

    def predict(self, theta: np.ndarray, r: np.ndarray) -> np.ndarray:
        return self.features(r) @ theta

    def fit(self, r: np.ndarray, y: np.ndarray, start: np.ndarray | None = None) -> np.ndarray:
        return np.linalg.lstsq(self.features(r), y, rcond=None)[0]


FORMS = {f.name: f for f in (ExpForm(), ScheffeForm())}


def loo_predictions(form, r: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Each proxy's loss predicted by the form fitted to all the other proxies."""
    keep = ~np.eye(len(y), dtype=bool)
    return np.array([form.predict(form.fit(r[keep[i]], y[keep[i]]), r[i]) for i in range(len(y))])


def rms_rel(pred: np.ndarray, y: np.ndarray) -> float:
    return float(np.sqrt(np.mean((pred / y - 1) ** 2)))


@dataclass
class SourceFit:
    """One source's law: the chosen form, its fit, bootstrap fits and both forms' held-out errors."""

    source: str
    form: str
    theta: np.ndarray
    samples: np.ndarray  # [resamples, params]
    param_names: list[str]
    held_out: dict[str, np.ndarray] = field(default_factory=dict)  # form -> leave-one-out predictions

    def predict(self, r: np.ndarray) -> np.ndarray:
        return FORMS[self.form].predict(self.theta, np.asarray(r, dtype=float))

    def predict_samples(self, r: np.ndarray) -> np.ndarray:
        """[resamples, ...]: the loss at ``r`` under every bootstrap fit."""
        return np.array([FORMS[self.form].predict(s, np.asarray(r, dtype=float)) for s in self.samples])


def check_proxies(r, losses: dict[str, np.ndarray]) -> np.ndarray:
    """The proportions as an array [proxies, sources], or a one-line UserError."""
    r = np.asarray(r, dtype=float)
    if r.ndim != 2 or len(r) < MIN_PROXIES or r.shape[1] < 2:
        raise UserError(f"a mixing law needs at least {MIN_PROXIES} proxy runs over 2 or more sources: found "
                        f"{len(r)} run(s) of {r.shape[-1] if r.ndim == 2 else 0} source(s); run more draws "
                        "(python launch.py -m experiment=mixture_search 'data.draw=range(0,16)')")
    if (r < 0).any() or not np.allclose(r.sum(axis=1), 1.0):
        raise UserError("proxy proportions must be >= 0 and sum to 1 per run")
    for name, y in losses.items():
        if len(y) != len(r) or not np.all(np.isfinite(y)) or (np.asarray(y) <= 0).any():
            raise UserError(f"val/{name}/loss: need one positive finite loss per proxy run")
    return r


def bootstrap_indices(count: int, resamples: int, seed: int) -> np.ndarray:
    """[resamples, count] resamples of the proxies, the same for every source."""
    return np.random.default_rng(seed).integers(0, count, size=(resamples, count))


def fit_source(name: str, sources: list[str], r: np.ndarray, y: np.ndarray, boot: np.ndarray,
               form: str = "auto") -> SourceFit:
    """The law of one source's loss: ``exp`` unless ``form`` says otherwise or (``auto``) the
    Scheffe regression predicts the proxies left out of the fit better; then its bootstrap."""
    y = np.asarray(y, dtype=float)
    held_out = {"exp": loo_predictions(FORMS["exp"], r, y)}
    if len(y) - 1 > len(FORMS["scheffe"].param_names(sources)):  # enough proxies left to fit it
        held_out["scheffe"] = loo_predictions(FORMS["scheffe"], r, y)
    if form == "auto":
        form = min(held_out, key=lambda f: (rms_rel(held_out[f], y), f != "exp"))
    elif form not in held_out:
        raise UserError(f"--form {form}: not enough proxies for it (or not one of {sorted(FORMS)})")
    law = FORMS[form]
    theta = law.fit(r, y)
    samples = np.array([law.fit(r[idx], y[idx], start=theta) for idx in boot])
    return SourceFit(name, form, theta, samples, law.param_names(sources), held_out)


@dataclass
class MixtureLaw:
    """Every validation source's law over the same sources' proportions."""

    sources: list[str]
    fits: dict[str, SourceFit]
    level: float = 0.95

    def interval(self, values: np.ndarray) -> tuple[float, float]:
        tail = 100 * (1 - self.level) / 2
        lo, hi = np.percentile(values, [tail, 100 - tail], axis=0)
        return float(lo), float(hi)

    def predict(self, r, weights: np.ndarray) -> float:
        """The target (a weighted sum of the validation sources' losses, in ``fits`` order) at ``r``."""
        return float(sum(w * f.predict(r) for w, f in zip(weights, self.fits.values())))

    def predict_samples(self, r, weights: np.ndarray) -> np.ndarray:
        return sum(w * f.predict_samples(r) for w, f in zip(weights, self.fits.values()))

    def held_out_target(self, weights: np.ndarray) -> np.ndarray:
        """Each proxy's target predicted with that proxy left out of the fit (the chosen forms)."""
        return sum(w * f.held_out[f.form] for w, f in zip(weights, self.fits.values()))


def fit_mixture_law(sources: list[str], r, losses: dict[str, np.ndarray], resamples: int = 200,
                    level: float = 0.95, seed: int = 0, form: str = "auto") -> MixtureLaw:
    """The law of every source in ``losses`` (val/<name>/loss per proxy) over proportions ``r``."""
    r = check_proxies(r, losses)
    boot = bootstrap_indices(len(r), resamples, seed)
    return MixtureLaw(list(sources), {n: fit_source(n, list(sources), r, np.asarray(y, dtype=float), boot, form)
                                      for n, y in losses.items()}, level)


def not_pinned(name: str, lo: float, hi: float) -> bool:
    """Whether an interval leaves its parameter free to change the loss term by PINNED_RATIO x or more."""
    if name.startswith("t["):
        return hi - lo > np.log(PINNED_RATIO)
    if name in ("c", "k"):
        return lo <= 0 or hi / lo > PINNED_RATIO
    return False  # a regression coefficient: its interval says what it says


def target_weights(spec: str, names: list[str]) -> np.ndarray:
    """``mean`` (every source alike), one source's name, or ``name=w,name=w`` (normalised)."""
    if spec == "mean":
        return np.full(len(names), 1.0 / len(names))
    parts = dict(p.split("=", 1) if "=" in p else (p, "1") for p in spec.split(","))
    unknown = sorted(set(parts) - set(names))
    if unknown:
        raise UserError(f"--target {spec}: unknown source(s) {unknown}; the validation sources are {names}")
    try:
        w = np.array([float(parts.get(n, 0.0)) for n in names])
    except ValueError as e:
        raise UserError(f"--target {spec}: weights must be numbers ({e})") from e
    if (w < 0).any() or w.sum() <= 0:
        raise UserError(f"--target {spec}: weights must be >= 0 with a positive sum")
    return w / w.sum()


def check_bounds(bounds: dict[str, tuple[float, float]], names: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(low, high) per source from ``{name: (lo, hi)}``, or a one-line UserError when a name is
    unknown, a bound is outside [0, 1] or reversed, or no mixture fits inside them."""
    unknown = sorted(set(bounds) - set(names))
    if unknown:
        raise UserError(f"--bound {unknown[0]}: unknown source; the sources are {names}")
    lo = np.array([bounds.get(n, (0.0, 1.0))[0] for n in names], dtype=float)
    hi = np.array([bounds.get(n, (0.0, 1.0))[1] for n in names], dtype=float)
    for n, a, b in zip(names, lo, hi):
        if not 0 <= a <= b <= 1:
            raise UserError(f"--bound {n}={a}:{b}: need 0 <= low <= high <= 1")
    if lo.sum() > 1 or hi.sum() < 1:
        raise UserError(f"--bound: no mixture fits (the lows sum to {lo.sum():.3g}, the highs to {hi.sum():.3g}; "
                        "proportions sum to 1)")
    return lo, hi


def optimal_mixture(law: MixtureLaw, weights: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                    seed: int = 0) -> np.ndarray:
    """The proportions minimising the target inside the bounds: SLSQP on the simplex from the best
    of a seeded Dirichlet scatter of feasible points and one point that is always feasible."""
    k = len(law.sources)
    span = hi - lo
    always = lo + (1 - lo.sum()) * (span / span.sum() if span.sum() > 0 else np.full(k, 1.0 / k))
    scatter = np.random.default_rng(seed).dirichlet(np.ones(k), size=256)
    scatter = scatter[((scatter >= lo) & (scatter <= hi)).all(axis=1)]
    points = np.vstack([always[None], scatter])
    values = np.array([law.predict(p, weights) for p in points])
    best = always
    for x0 in points[np.argsort(values)[:6]]:
        res = minimize(lambda x: law.predict(x, weights), x0, method="SLSQP", bounds=list(zip(lo, hi)),
                       constraints=[{"type": "eq", "fun": lambda x: x.sum() - 1}],
                       options={"ftol": 1e-12, "maxiter": 500})
        x = np.clip(res.x, lo, hi)
        x = x / x.sum()
        if law.predict(x, weights) < law.predict(best, weights):
            best = x
    return best
