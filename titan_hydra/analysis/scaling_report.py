"""A scaling ladder's runs as a scaling-law fit: read, fit, report, draw.

Reads every completed job of the multirun dir(s) (``sweep.collect``), sizes each from its own
``.hydra/config.yaml`` with the planner: N = parameters (``non_embedding``: all but the input
embedding table, whose lookup costs no FLOPs; ``total``), D = tokens seen (the run's logged tokens
per step, ``runs.tokens_of``), C = the planner's FLOPs per token x D; and its loss (``val``: the
last validation loss; ``train``: the mean training loss over the last tenth of the steps). Then
fits ``L(N, D) = E + A/N^alpha + B/D^beta`` with bootstrap intervals and the IsoFLOP minima
(scaling_law.py, isoflop.py). ``recipes/scaling_law.py`` is its command line.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from titan_hydra.analysis import figures
from titan_hydra.analysis.isoflop import IsoFlop, isoflop_minima
from titan_hydra.analysis.runs import job_config, tokens_of
from titan_hydra.analysis.scaling_law import PARAMS, PINNED_DECADES, Fit, bootstrap_fit
from titan_hydra.analysis.sweep import JobRow, collect
from titan_hydra.errors import UserError
from titan_hydra.planner.plan import plan
from titan_hydra.spec import spec_of

TRAIN_TAIL = 0.1  # --loss train: the mean over this last fraction of the logged steps


@dataclass(frozen=True)
class Run:
    """One job of the ladder as the fit sees it."""

    where: str  # <multirun dir>/<job>
    label: str
    n: float
    d: float
    flops: float
    loss: float


def job_loss(row: JobRow, kind: str) -> float | None:
    if kind == "val":
        return row.val_loss
    tail = row.curve[-max(1, round(len(row.curve) * TRAIN_TAIL)):]
    return float(np.mean([loss for _, loss in tail])) if tail else None


def size_of(run_dir: Path, params: str) -> tuple[float, float]:
    """(parameters, FLOPs per token) of the run, planned from its saved config."""
    p = plan(spec_of(job_config(run_dir)))
    return float(p.non_embedding_params if params == "non_embedding" else p.params), p.flops_per_token


def read_runs(sweep_dirs: list[Path], loss: str, params: str) -> list[Run]:
    """The completed jobs with a loss; a job that failed or logged no loss is left out (said on stdout)."""
    runs = []
    for sweep_dir in sweep_dirs:
        if not sweep_dir.is_dir():
            raise UserError(f"{sweep_dir} is not a directory (a multirun dir: hydra.sweep.dir)")
        for row in collect(sweep_dir):
            value = job_loss(row, loss)
            if row.status != "completed" or value is None:
                print(f"skipped {sweep_dir}/{row.job}: {row.status}{' ' + row.error if row.error else ''}"
                      f"{'' if value is not None else f', no {loss} loss'}")
                continue
            n, flops_per_token = size_of(sweep_dir / str(row.job), params)
            d = float(tokens_of(sweep_dir / str(row.job)).through(row.steps))
            runs.append(Run(f"{sweep_dir}/{row.job}", row.overrides, n, d, flops_per_token * d, float(value)))
    return runs


def held_out(runs: list[Run], fit: Fit) -> list[dict]:
    """Runs left out of the fit, each with the loss the fit predicted for it and the interval."""
    out = []
    for r in runs:
        loss, lo, hi = fit.predict(r.n, r.d)
        out.append({**asdict(r), "predicted": loss, "interval": [lo, hi], "inside": lo <= r.loss <= hi})
    return out


def record_of(runs: list[Run], fit: Fit, iso: IsoFlop, params: str, loss: str, flops: list[float],
              holdout: list[Path]) -> dict:
    """Everything the fit JSON holds: how N and the loss were read, the runs, both fits, the optima."""
    cols = {k: np.array([getattr(r, k) for r in runs]) for k in ("n", "d", "flops", "loss")}
    flops_per_nd = float(np.median(cols["flops"] / (cols["n"] * cols["d"])))
    return {
        "params": params, "loss": loss, "flops_per_nd": flops_per_nd,
        "runs": [asdict(r) for r in runs],
        "fit": fit.as_dict(),
        "isoflop": iso.as_dict(),
        "optimal": [fit.optimal(c, flops_per_nd) for c in flops],
        "held_out": held_out(read_runs(holdout, loss, params), fit) if holdout else [],
    }


def report(record: dict, fit: Fit) -> str:
    law, iv = fit.law, fit.param_intervals()
    lines = [f"{len(record['runs'])} runs; N = {record['params']} parameters, loss = {record['loss']} loss, "
             f"C = {record['flops_per_nd']:.2f} N D (the planner's FLOPs)", "",
             f"{'N':>12} {'D':>12} {'C':>10} {'loss':>8} {'fit':>8}  run"]
    for r in record["runs"]:
        lines.append(f"{r['n']:12,.0f} {r['d']:12,.0f} {r['flops']:10.3g} {r['loss']:8.4f} "
                     f"{float(law.loss(r['n'], r['d'])):8.4f}  {r['where']}")
    lines += ["", f"L(N, D) = E + A/N^alpha + B/D^beta  ({fit.level:.0%} bootstrap intervals, {len(fit.samples)} resamples)"]
    loose = fit.not_pinned()
    lines += [f"  {p:<6} {getattr(law, p):12.5g}  [{iv[p][0]:.5g}, {iv[p][1]:.5g}]" + ("  not pinned" if p in loose else "")
              for p in PARAMS]
    if loose:
        lines.append(f"  not pinned: {', '.join(loose)} (interval over {PINNED_DECADES:g} decades): these runs do not fix "
                     "them one by one, only together; the law's losses inside the runs' range of N and D still hold "
                     "(see held out), its parameter values and far extrapolations do not")
    a_law = law.beta / (law.alpha + law.beta)
    iso = record["isoflop"]
    found = sum(p["n_opt"] is not None for p in iso["profiles"])
    if not iso["profiles"]:
        lines.append("IsoFLOP panel left out of the figure: no FLOP budget is reached by 3 model sizes")
    lines.append(f"N_opt ~ C^a: a = {a_law:.3f} from the fit (beta / (alpha + beta)); "
                 + (f"a = {iso['a']:.3f}, D_opt ~ C^{iso['b']:.3f} from the IsoFLOP minima of {found} budgets"
                    if iso["a"] is not None else f"IsoFLOP minima: {found} budget(s) with an interior minimum, "
                    "too few for an exponent"))
    for h in record["held_out"]:
        lines.append(f"held out {h['where']} (N = {h['n']:,.0f}, D = {h['d']:,.0f}): predicted {h['predicted']:.4f} "
                     f"[{h['interval'][0]:.4f}, {h['interval'][1]:.4f}], measured {h['loss']:.4f} "
                     f"({(h['loss'] / h['predicted'] - 1):+.1%}{'' if h['inside'] else ', outside the interval'})")
    for o in record["optimal"]:
        lines.append(f"compute-optimal at C = {o['flops']:.3g}: N = {o['n']:,.0f} [{o['n_interval'][0]:,.0f}, "
                     f"{o['n_interval'][1]:,.0f}], D = {o['d']:,.0f} [{o['d_interval'][0]:,.0f}, {o['d_interval'][1]:,.0f}] "
                     f"tokens, loss {o['loss']:.4f} [{o['loss_interval'][0]:.4f}, {o['loss_interval'][1]:.4f}]")
    return "\n".join(lines)


def plot_isoflop(ax, record: dict, fit: Fit) -> None:
    """Loss against N at each budget (runs interpolated to it), the parabola's vertex, and the law's curve."""
    for i, prof in enumerate(record["isoflop"]["profiles"]):
        color = f"C{i % 10}"
        ax.plot(prof["n"], prof["loss"], "o", color=color, label=f"C = {prof['flops']:.2g}")
        grid = np.geomspace(min(prof["n"]) / 1.5, max(prof["n"]) * 1.5, 60)
        ax.plot(grid, fit.law.loss(grid, prof["flops"] / (record["flops_per_nd"] * grid)), "--", color=color)
        if prof["n_opt"] is not None:
            ax.plot(prof["n_opt"], prof["loss_opt"], "*", color=color, markersize=12)
    ax.set_xscale("log")
    ax.set(xlabel=f"N ({record['params']} parameters)", ylabel=f"{record['loss']} loss",
           title="IsoFLOP profiles (*: parabola minimum; --: fit)")
    ax.legend(fontsize=7)


def plot_tokens(ax, record: dict, fit: Fit) -> None:
    """Loss against D, one color per model size, the fitted law through each."""
    sizes = sorted({r["n"] for r in record["runs"]})
    for i, n in enumerate(sizes):
        runs = sorted((r["d"], r["loss"]) for r in record["runs"] if r["n"] == n)
        d, loss = zip(*runs)
        grid = np.geomspace(min(d) / 1.5, max(d) * 1.5, 60)
        ax.plot(d, loss, "o", color=f"C{i % 10}", label=f"N = {n:,.0f}")
        ax.plot(grid, fit.law.loss(n, grid), "-", color=f"C{i % 10}", alpha=0.6)
    for j, h in enumerate(record["held_out"]):
        color = f"C{(len(sizes) + j) % 10}"
        ax.errorbar(h["d"], h["predicted"], yerr=figures.interval_bar(h["predicted"], h["interval"]),
                    fmt="s", mfc="none", color=color, capsize=4, label=f"predicted, N = {h['n']:,.0f}")
        ax.plot(h["d"], h["loss"], "D", color=color, label="held out, measured")
    ax.set_xscale("log")
    ax.set(xlabel="D (tokens)", ylabel=f"{record['loss']} loss", title="Runs and the fitted L(N, D)")
    ax.legend(fontsize=7)


def plot_optimum(ax, record: dict, fit: Fit) -> None:
    """Compute-optimal N against C: the IsoFLOP vertices, their power law, and the fit's closed form."""
    iso = record["isoflop"]
    found = [p for p in iso["profiles"] if p["n_opt"] is not None]
    flops = np.geomspace(min(r["flops"] for r in record["runs"]), max(r["flops"] for r in record["runs"]), 40)
    ax.plot(flops, [fit.law.optimal(c, record["flops_per_nd"])[0] for c in flops], "-", label="from the fit")
    if found:
        ax.plot([p["flops"] for p in found], [p["n_opt"] for p in found], "*", markersize=12, label="IsoFLOP minima")
    if iso["log_n_coef"] is not None:
        slope, icept = iso["log_n_coef"]
        ax.plot(flops, np.exp(icept) * flops**slope, ":", label=f"N_opt ~ C^{slope:.2f}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set(xlabel="C (FLOPs)", ylabel="compute-optimal N", title="Optimal model size")
    ax.legend(fontsize=7)


def label_log_axes(ax) -> None:
    """Numbers on every log axis. Its minor labels only crowd the major ones, so they go; where
    fewer than two major ticks (powers of ten) are in view, the major ticks move to 1, 2, 5 x 10^k
    (every digit below half a decade) so the axis still carries numbers."""
    from matplotlib.ticker import LogFormatterSciNotation, LogLocator  # matplotlib: only where a figure is drawn

    for name, axis, lim in (("x", ax.xaxis, ax.get_xlim()), ("y", ax.yaxis, ax.get_ylim())):
        if axis.get_scale() != "log":
            continue
        lo, hi = sorted(lim)
        ax.tick_params(axis=name, which="minor", labelbottom=False, labelleft=False)
        if sum(lo <= t <= hi for t in axis.get_majorticklocs()) < 2:
            subs = (1.0, 2.0, 5.0) if np.log10(hi / lo) >= 0.5 else tuple(range(1, 10))
            axis.set_major_locator(LogLocator(subs=subs))
            axis.set_major_formatter(LogFormatterSciNotation(labelOnlyBase=False, minor_thresholds=(np.inf, np.inf)))


def figure(record: dict, fit: Fit):
    """The report's panels; the IsoFLOP one only where some budget is reached by 3 sizes."""
    panels = ([plot_isoflop] if record["isoflop"]["profiles"] else []) + [plot_tokens, plot_optimum]
    fig, axes = figures.subplots(1, len(panels), figsize=(5.4 * len(panels), 4.6))
    for ax, panel in zip(axes, panels):
        panel(ax, record, fit)
        label_log_axes(ax)
    fig.tight_layout()
    return fig


def fit_sweeps(sweep_dirs: list[Path], loss: str = "val", params: str = "non_embedding", resamples: int = 200,
               level: float = 0.95, flops: list[float] = (), holdout: list[Path] = ()) -> tuple[dict, Fit]:
    """(the record scaling_law.json holds, the fit) of the completed jobs of ``sweep_dirs``."""
    runs = read_runs(sweep_dirs, loss, params)
    cols = [[getattr(r, k) for r in runs] for k in ("n", "d", "flops", "loss")]
    fit = bootstrap_fit(cols[0], cols[1], cols[3], resamples=resamples, level=level)
    return record_of(runs, fit, isoflop_minima(*cols), params, loss, list(flops), list(holdout)), fit


def write(record: dict, fit: Fit, out: Path) -> str:
    """``scaling_law.json`` and ``scaling_law.png`` into ``out``; the line that says so."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaling_law.json").write_text(json.dumps(record, indent=1))
    figures.save(figure(record, fit), out / "scaling_law.png")
    return f"wrote {out / 'scaling_law.json'} and {out / 'scaling_law.png'}"
