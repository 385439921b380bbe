"""Data mixing laws (titan_hydra/analysis/mixture_law.py, recipes/mixture_law.py): the fit recovers
a law it did not make within its bootstrap intervals, the optimiser finds a closed-form optimum
(and stops at a bound), bad targets and bounds are refused in one line, and a 2-job
``experiment=mixture_search`` sweep runs into the recipe, whose printed weights compose back into a
valid config."""

from __future__ import annotations

import contextlib
import io
import json
import sys

import numpy as np
import pytest

from helpers import REPO, TINY, compose_cfg, run_launch
from test_mixture import prepared
from titan_hydra.config.mixture_draw import dirichlet_weights
from titan_hydra.errors import UserError
from titan_hydra.analysis.mixture_law import (MixtureLaw, SourceFit, check_bounds, fit_mixture_law,
                                             optimal_mixture, target_weights)
from titan_hydra.spec import spec_of
from titan_hydra.validate import validate

sys.path.insert(0, str(REPO / "recipes"))
import mixture_law  # noqa: E402

NAMES = ["python", "c", "docs"]
# per source: (c, k, t) of c + k exp(t . r), not centred: the fit must find the centred twin
TRUTH = {"python": (2.0, 1.5, [-3.0, 1.0, 0.5]), "c": (2.5, 1.0, [0.5, -2.0, 1.0]), "docs": (3.0, 2.0, [1.0, 0.2, -4.0])}
NOISE = 1e-3


def centred(c: float, k: float, t: list[float]) -> np.ndarray:
    """The same law with sum(t) = 0: k exp(t . r) = k e^mean(t) exp((t - mean t) . r) on the simplex."""
    t = np.asarray(t)
    return np.concatenate([[c, k * np.exp(t.mean())], t - t.mean()])


def test_the_fit_recovers_a_law_it_did_not_make_within_its_intervals():
    rng = np.random.default_rng(7)
    r = rng.dirichlet(np.ones(3), size=24)
    losses = {n: (c + k * np.exp(r @ np.asarray(t))) * (1 + NOISE * rng.standard_normal(len(r)))
              for n, (c, k, t) in TRUTH.items()}
    law = fit_mixture_law(NAMES, r, losses, resamples=100)
    for name, fit in law.fits.items():
        assert fit.form == "exp", (name, fit.held_out)  # the regression predicts left-out proxies worse here
        truth = centred(*TRUTH[name])
        lo, hi = (np.percentile(fit.samples, q, axis=0) for q in (2.5, 97.5))
        assert ((lo <= truth) & (truth <= hi)).all(), (name, truth, lo, hi)
        assert (lo <= fit.theta).all() and (fit.theta <= hi).all()
    # the interval of a prediction covers the noise-free loss at a mixture no proxy had
    mid = np.array([0.2, 0.5, 0.3])
    c, k, t = TRUTH["c"]
    lo, hi = law.interval(law.fits["c"].predict_samples(mid))
    assert lo <= c + k * np.exp(mid @ np.asarray(t)) <= hi


def two_source_law(ka: float, kb: float, s: float) -> MixtureLaw:
    """L_a = 1 + ka exp(s (r_b - r_a)), L_b = 1 + kb exp(s (r_a - r_b)): the mean is smallest at
    r_a = 1/2 + ln(ka / kb) / (4 s) (set its derivative to zero)."""
    fits = {}
    for name, k, t in (("a", ka, [-s, s]), ("b", kb, [s, -s])):
        theta = np.array([1.0, k, *t])
        fits[name] = SourceFit(name, "exp", theta, theta[None].repeat(3, axis=0), ["c", "k", "t[a]", "t[b]"])
    return MixtureLaw(["a", "b"], fits)


def test_the_optimiser_finds_the_closed_form_optimum_and_stops_at_a_bound():
    ka, kb, s = 2.0, 0.5, 1.5
    law = two_source_law(ka, kb, s)
    best = 0.5 + np.log(ka / kb) / (4 * s)  # 0.731
    weights = target_weights("mean", ["a", "b"])
    found = optimal_mixture(law, weights, *check_bounds({}, ["a", "b"]))
    # SLSQP stops at ftol 1e-12 on a target of curvature ~ 8 s^2 k: x within sqrt(1e-12) of the optimum
    assert found == pytest.approx([best, 1 - best], abs=1e-5)
    bounded = optimal_mixture(law, weights, *check_bounds({"a": (0.1, 0.6)}, ["a", "b"]))
    assert bounded == pytest.approx([0.6, 0.4], abs=1e-9)  # convex along the simplex: the nearest bound
    only_b = optimal_mixture(law, target_weights("b", ["a", "b"]), *check_bounds({}, ["a", "b"]))
    assert only_b == pytest.approx([0.0, 1.0], abs=1e-9)  # b's own loss falls as its share grows


@pytest.mark.parametrize("call,match", [
    (lambda: target_weights("math", NAMES), r"--target math: unknown source\(s\) \['math'\]"),
    (lambda: target_weights("python=1,c=x", NAMES), r"--target python=1,c=x: weights must be numbers"),
    (lambda: check_bounds({"math": (0, 1)}, NAMES), r"--bound math: unknown source"),
    (lambda: check_bounds({"docs": (0.6, 0.2)}, NAMES), r"--bound docs=0.6:0.2: need 0 <= low <= high <= 1"),
    (lambda: check_bounds({"docs": (0.6, 1), "c": (0.5, 1)}, NAMES), r"--bound: no mixture fits"),
    (lambda: fit_mixture_law(NAMES, [[1.0, 0.0, 0.0]], {"c": [4.0]}), r"a mixing law needs at least 2 proxy runs"),
], ids=["unknown_target", "bad_weight", "unknown_bound", "reversed", "infeasible", "one_run"])
def test_bad_targets_and_bounds_are_refused_in_one_line(call, match):
    with pytest.raises(UserError, match=match) as err:
        call()
    assert "\n" not in str(err.value)


@pytest.mark.slow
@pytest.mark.extended
def test_a_two_job_search_runs_into_the_recipe_and_its_weights_paste_back(tmp_path):
    words = {"python": "def return class import self value list dict for in if else",
             "c": "int char void struct static const unsigned long return if while for",
             "docs": "the of and to in is for that with as on by this be are"}
    paths = [f"data.sources.{n}.path={prepared(tmp_path, n, w.split(), 120)}" for n, w in words.items()]
    tiny = [o for o in TINY if not o.startswith("data.")] + ["training.seq_len=32", "training.steps=4",
                                                             "training.val_steps=1"]
    sweep = tmp_path / "sweep"
    proc = run_launch(["-m", "experiment=mixture_search", "data.draw=0,1", *paths, *tiny, f"hydra.sweep.dir={sweep}"],
                      cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert mixture_law.main([str(sweep), "--resamples", "10"]) == 0
    record = json.loads((sweep / "mixture_law.json").read_text())
    assert (sweep / "mixture_law.png").stat().st_size > 10_000
    for job, proxy in enumerate(record["proxies"]):  # each job's weights: its own draw, read back from its config
        w = dirichlet_weights(job, 1.0, 3)
        assert list(proxy["proportions"].values()) == pytest.approx(list(w / w.sum()), abs=1e-12)
        assert set(proxy["losses"]) == set(words)
    assert "not pinned" in out.getvalue()  # two runs cannot pin five parameters per source, and it says so
    printed = out.getvalue().split("optimum: ")[1].splitlines()[1].split()
    cfg = compose_cfg(["experiment=mixture_search", *paths, *tiny, *printed])
    validate(cfg)
    spec_of(cfg)  # the run's one reader takes it
    best = record["optimum"]["proportions"]
    assert {n: float(cfg.data.sources[n].weight) for n in words} == pytest.approx(best, abs=1e-4)
    assert cfg.data.draw is None
    for bad in (["--target", "math"], ["--bound", "docs=0.7:0.2"]):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            assert mixture_law.main([str(sweep), *bad]) == 2
        assert err.getvalue().startswith("error: --") and err.getvalue().count("\n") == 1
