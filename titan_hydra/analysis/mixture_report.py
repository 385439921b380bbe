"""A mixture search's proxy runs as data mixing laws: read, fit, find the best mixture, report.

Reads every completed job of the multirun dir(s) (``sweep.collect``): its mixture from its own
``.hydra/config.yaml`` (the weights resolved, ``${th_dirichlet:}`` draws included, as proportions)
and its last ``val/<name>/loss`` per source. Fits per source a data mixing law (mixture_law.py)
with bootstrap intervals, predicts each proxy with it left out, finds the mixture minimising the
target inside the bounds, and predicts check runs at another scale from the shift the other
check runs measured. ``recipes/mixture_law.py`` is its command line; the figure is mixture_plots.py.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from titan_hydra.analysis.mixture_law import (MixtureLaw, check_bounds, fit_mixture_law, not_pinned, optimal_mixture,
                                              target_weights)
from titan_hydra.analysis.mixture_plots import write_plot
from titan_hydra.analysis.runs import job_config
from titan_hydra.analysis.sweep import collect
from titan_hydra.errors import UserError

DIGITS = 4  # printed proportions: what a person pastes


@dataclass(frozen=True)
class Run:
    """One job as the fit sees it: its sources' proportions and validation losses."""

    where: str
    proportions: dict[str, float]
    losses: dict[str, float]
    paths: dict[str, str]


def mixture_of(run_dir: Path) -> tuple[dict[str, float], dict[str, str]]:
    """(proportions, paths) of a job's ``data.sources``, resolved from its saved config (the weights
    may be ``${th_dirichlet:...}`` draws)."""
    cfg = job_config(run_dir)
    sources = OmegaConf.to_container(cfg.data.sources, resolve=True) if cfg.data.get("sources") else None
    if not sources:
        raise UserError(f"{run_dir}: not a data=mixture run (no data.sources in .hydra/config.yaml)")
    weights = {n: float(s.get("weight", 1.0)) for n, s in sources.items()}
    total = sum(weights.values())
    return {n: w / total for n, w in weights.items()}, {n: str(s.get("path", "")) for n, s in sources.items()}


def read_runs(sweep_dirs: list[Path]) -> list[Run]:
    """The completed jobs with every source's validation loss; others are skipped (said on stdout)."""
    runs = []
    for sweep_dir in sweep_dirs:
        if not sweep_dir.is_dir():
            raise UserError(f"{sweep_dir} is not a directory (a multirun dir: hydra.sweep.dir)")
        for row in collect(sweep_dir):
            losses = {n: curve[-1][1] for n, curve in row.source_curves.items() if curve}
            if row.status != "completed" or not losses:
                print(f"skipped {sweep_dir}/{row.job}: {row.status}{' ' + row.error if row.error else ''}"
                      f"{'' if losses else ', no val/<source>/loss'}")
                continue
            proportions, paths = mixture_of(sweep_dir / str(row.job))
            runs.append(Run(f"{sweep_dir}/{row.job}", proportions, losses, paths))
    if runs and any(set(r.proportions) != set(runs[0].proportions) for r in runs):
        raise UserError("the runs mix different sources; fit one search at a time")
    return runs


def natural_proportions(paths: dict[str, str]) -> dict[str, float] | None:
    """Each source's share of the training tokens (from its prepared manifest), or None if unread."""
    try:
        tokens = {n: json.loads((Path(p) / "manifest.json").read_text())["splits"]["train"]["tokens"]
                  for n, p in paths.items()}
    except (OSError, ValueError, KeyError):
        return None
    total = sum(tokens.values())
    return {n: t / total for n, t in tokens.items()}


def overrides(proportions: dict[str, float]) -> str:
    """The mixture as command-line overrides (``data.draw=null``: the weights are not a draw)."""
    return "data.draw=null " + " ".join(f"data.sources.{n}.weight={w:.{DIGITS}f}" for n, w in proportions.items())


def parse_bounds(specs: list[str]) -> dict[str, tuple[float, float]]:
    """``name=low:high`` per --bound."""
    out = {}
    for spec in specs:
        try:
            name, rng = spec.split("=", 1)
            lo, hi = (float(x) for x in rng.split(":"))
        except ValueError:
            raise UserError(f"--bound {spec}: expected name=low:high, e.g. docs=0.05:0.5") from None
        out[name] = (lo, hi)
    return out


def point(law: MixtureLaw, weights: np.ndarray, proportions: dict[str, float], sigma: float,
          rng: np.random.Generator) -> dict:
    """A mixture's predicted target with its bootstrap interval, and the prediction interval of
    one run of it (the bootstrap plus the proxies' held-out scatter ``sigma``)."""
    r = np.array([proportions[n] for n in law.sources])
    samples = law.predict_samples(r, weights)
    return {"proportions": proportions, "predicted": law.predict(r, weights),
            "interval": list(law.interval(samples)),
            "run_interval": list(law.interval(samples + sigma * rng.standard_normal(len(samples)))),
            "overrides": overrides(proportions)}


def measured_target(run: Run, law: MixtureLaw, weights: np.ndarray) -> float:
    return float(sum(w * run.losses[n] for w, n in zip(weights, law.fits)))


def check_predictions(law: MixtureLaw, weights: np.ndarray, checks: list[Run], sigma: float,
                      rng: np.random.Generator) -> list[dict]:
    """Each check run's target predicted at its own scale: the law at its mixture plus the mean
    shift (measured - law) of the other check runs, bootstrap sample by sample, plus run scatter."""
    rs = [np.array([c.proportions[n] for n in law.sources]) for c in checks]
    measured = np.array([measured_target(c, law, weights) for c in checks])
    full = np.array([law.predict(r, weights) for r in rs])
    boot = np.array([law.predict_samples(r, weights) for r in rs])  # [checks, resamples]
    out = []
    for i, c in enumerate(checks):
        others = [j for j in range(len(checks)) if j != i]
        shift = float(np.mean(measured[others] - full[others])) if others else 0.0
        shift_b = np.mean(measured[others, None] - boot[others], axis=0) if others else 0.0
        noise = sigma * np.sqrt(1 + 1 / max(len(others), 1)) * rng.standard_normal(boot.shape[1])
        lo, hi = law.interval(boot[i] + shift_b + noise)
        out.append({"where": c.where, "proportions": c.proportions, "measured": float(measured[i]),
                    "law": float(full[i]), "shift": shift, "predicted": float(full[i] + shift),
                    "interval": [lo, hi], "inside": bool(lo <= measured[i] <= hi)})
    return out


def laws_of(law: MixtureLaw, runs: list[Run]) -> dict:
    """Per source: the chosen form, its parameters with intervals (and which are not pinned), and
    both forms' held-out relative errors."""
    out = {}
    for name, f in law.fits.items():
        y = np.array([r.losses[name] for r in runs])
        iv = {p: law.interval(f.samples[:, i]) for i, p in enumerate(f.param_names)}
        out[name] = {"form": f.form, "params": dict(zip(f.param_names, map(float, f.theta))),
                     "intervals": {p: list(v) for p, v in iv.items()},
                     "not_pinned": [p for p, (lo, hi) in iv.items() if not_pinned(p, lo, hi)],
                     "held_out_rms_rel": {k: float(np.sqrt(np.mean((v / y - 1) ** 2))) for k, v in f.held_out.items()},
                     "held_out": [float(v) for v in f.held_out[f.form]]}
    return out


def record_of(law: MixtureLaw, runs: list[Run], checks: list[Run], target: str, bounds: list[str]) -> dict:
    """Everything the JSON holds: the proxies, the laws, the held-out error, the optimum beside the
    uniform and natural mixtures, and the check runs."""
    names = law.sources
    weights = target_weights(target, list(law.fits))
    lo, hi = check_bounds(parse_bounds(bounds), names)
    measured = np.array([measured_target(r, law, weights) for r in runs])
    loo = law.held_out_target(weights)
    sigma = float(np.sqrt(np.mean((measured - loo) ** 2)))
    rng = np.random.default_rng(0)
    best = optimal_mixture(law, weights, lo, hi)
    natural = natural_proportions(runs[0].paths)
    return {
        "sources": names, "val_sources": list(law.fits), "target": target,
        "target_weights": dict(zip(law.fits, map(float, weights))),
        "bounds": {n: [float(a), float(b)] for n, a, b in zip(names, lo, hi)}, "level": law.level,
        "resamples": len(next(iter(law.fits.values())).samples),
        "proxies": [{**asdict(r), "target": float(m), "held_out": float(p)} for r, m, p in zip(runs, measured, loo)],
        "laws": laws_of(law, runs),
        "held_out": {"rms": sigma, "rms_rel": float(np.sqrt(np.mean((loo / measured - 1) ** 2))),
                     "max_rel": float(np.max(np.abs(loo / measured - 1)))},
        "optimum": point(law, weights, dict(zip(names, map(float, best))), sigma, rng),
        "uniform": point(law, weights, {n: 1 / len(names) for n in names}, sigma, rng),
        "natural": point(law, weights, natural, sigma, rng) if natural else None,
        "checks": check_predictions(law, weights, checks, sigma, rng) if checks else [],
    }


def pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def mixture_text(p: dict) -> str:
    return ", ".join(f"{n} {w:.3f}" for n, w in p["proportions"].items())


def law_lines(record: dict) -> list[str]:
    """Each source's law, its parameters with intervals, and a word where the runs do not pin them."""
    lines = [f"laws ({record['level']:.0%} bootstrap intervals, {record['resamples']} resamples of the proxies):"]
    for name, law in record["laws"].items():
        errs = law["held_out_rms_rel"]
        other = ", ".join(f"{k} {pct(v)}" for k, v in errs.items() if k != law["form"])
        shape = "c + k exp(sum_j t_j r_j), sum_j t_j = 0" if law["form"] == "exp" else "Scheffe quadratic in r"
        lines.append(f"  val/{name}/loss: {law['form']} ({shape}); held-out error {pct(errs[law['form']])}"
                     + (f" ({other})" if other else ""))
        lines += [f"    {p:<16} {v:10.4g}  [{law['intervals'][p][0]:.4g}, {law['intervals'][p][1]:.4g}]"
                  + ("  not pinned" if p in law["not_pinned"] else "") for p, v in law["params"].items()]
        if law["not_pinned"]:
            lines.append(f"    not pinned: {', '.join(law['not_pinned'])} (the interval lets its term change more "
                         "than 100x): these proxies fix the parameters together, not one by one; the law's losses "
                         "inside the proxies' range still hold (see held out), its parameter values do not")
    return lines


def report(record: dict) -> str:
    names, vals = record["sources"], record["val_sources"]
    target = ", ".join(f"{n} {w:.3g}" for n, w in record["target_weights"].items())
    lines = [f"{len(record['proxies'])} proxy runs over {len(names)} sources; target {record['target']} = "
             f"weighted val/<source>/loss ({target})", "",
             " ".join(f"{'r_' + n:>8}" for n in names) + " | " + " ".join(f"{n:>8}" for n in vals)
             + " | target held-out  run"]
    for p in record["proxies"]:
        lines.append(" ".join(f"{p['proportions'][n]:8.3f}" for n in names) + " | "
                     + " ".join(f"{p['losses'][n]:8.4f}" for n in vals) + f" | {p['target']:6.4f} {p['held_out']:8.4f}"
                     f"  {p['where']}")
    ho = record["held_out"]
    lines += ["", *law_lines(record), "",
              f"held out: each proxy's target predicted by the laws fitted without it: {pct(ho['rms_rel'])} RMS, "
              f"{pct(ho['max_rel'])} at most", ""]
    for key in ("optimum", "uniform", "natural"):
        p = record[key]
        if p is None:
            lines.append(f"{key}: unknown (a source's prepared manifest.json was not found)")
            continue
        lines += [f"{key}: {mixture_text(p)}: predicted {p['predicted']:.4f} [{p['interval'][0]:.4f}, "
                  f"{p['interval'][1]:.4f}] (one run: [{p['run_interval'][0]:.4f}, {p['run_interval'][1]:.4f}])",
                  f"  {p['overrides']}"]
    for c in record["checks"]:
        lines.append(f"check {c['where']} ({mixture_text(c)}): measured {c['measured']:.4f}, predicted "
                     f"{c['predicted']:.4f} [{c['interval'][0]:.4f}, {c['interval'][1]:.4f}] (law {c['law']:.4f} "
                     f"{c['shift']:+.4f} shift of the other check runs){'' if c['inside'] else ', outside the interval'}")
    return "\n".join(lines)


def fit_and_record(sweep_dirs: list[Path], target: str = "mean", bounds: list[str] = (), form: str = "auto",
                   resamples: int = 200, level: float = 0.95, check: list[Path] = ()) -> tuple[MixtureLaw, dict]:
    """(the law, the record mixture_law.json holds) of the proxy runs in ``sweep_dirs``."""
    runs = read_runs(sweep_dirs)
    if not runs:
        raise UserError(f"no completed proxy run with val/<source>/loss in {', '.join(map(str, sweep_dirs))}")
    names = list(runs[0].proportions)
    vals = [n for n in names if n in runs[0].losses]
    target_weights(target, vals)  # a bad target or bound: one line before the fit's seconds
    check_bounds(parse_bounds(list(bounds)), names)
    r = [[run.proportions[n] for n in names] for run in runs]
    law = fit_mixture_law(names, r, {n: [run.losses[n] for run in runs] for n in vals}, resamples=resamples,
                          level=level, form=form)
    return law, record_of(law, runs, read_runs(list(check)) if check else [], target, list(bounds))


def write(record: dict, law: MixtureLaw, out: Path) -> str:
    """``mixture_law.json`` and ``mixture_law.png`` into ``out``; the line that says so."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "mixture_law.json").write_text(json.dumps(record, indent=1))
    write_plot(record, law, target_weights(record["target"], record["val_sources"]), out / "mixture_law.png")
    return f"wrote {out / 'mixture_law.json'} and {out / 'mixture_law.png'}"
