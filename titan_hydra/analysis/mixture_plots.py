"""The figure of a mixture law (recipes/mixture_law.py): held-out predictions against measured losses, and the
target against each source's proportion. Every axis that carries data is labelled; a panel with
nothing to show is left out."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from titan_hydra.analysis import figures
from titan_hydra.analysis.mixture_law import MixtureLaw


def plot_held_out(ax, record: dict) -> None:
    """Each proxy's loss predicted with it left out of the fit, against what it measured; the
    check runs (another scale) predicted from the other check runs' shift, with intervals."""
    for i, name in enumerate(record["val_sources"]):
        measured = [p["losses"][name] for p in record["proxies"]]
        ax.plot(measured, record["laws"][name]["held_out"], "o", color=f"C{i % 10}", ms=4, label=f"val/{name}/loss")
    ax.plot([p["target"] for p in record["proxies"]], [p["held_out"] for p in record["proxies"]], "k^", ms=5,
            label=f"target ({record['target']})")
    for c in record["checks"]:
        ax.errorbar(c["measured"], c["predicted"], yerr=figures.interval_bar(c["predicted"], c["interval"]), fmt="D",
                    color="k", mfc="none", capsize=3)
    if record["checks"]:
        ax.plot([], [], "D", color="k", mfc="none", label="check runs (bars: interval)")
    lims = [min(ax.get_xlim()[0], ax.get_ylim()[0]), max(ax.get_xlim()[1], ax.get_ylim()[1])]
    ax.plot(lims, lims, ":", color="grey")
    ax.set(xlabel="measured validation loss", ylabel="predicted (proxy left out of the fit)",
           title=f"Held out: {100 * record['held_out']['rms_rel']:.2f}% RMS error on the target")
    ax.legend(fontsize=7)


def plot_source(ax, record: dict, law: MixtureLaw, weights: np.ndarray, j: int) -> None:
    """The target against source j's proportion: the proxies, and the law along the line through
    the optimum (the other sources keep the optimum's ratios) with its bootstrap band."""
    names = record["sources"]
    name = names[j]
    best = np.array([record["optimum"]["proportions"][n] for n in names])
    rest = np.delete(best, j)
    rest = rest / rest.sum() if rest.sum() > 0 else np.full(len(rest), 1 / len(rest))
    xs = np.linspace(0, 1, 41)
    rs = np.array([np.insert((1 - x) * rest, j, x) for x in xs])
    samples = np.array([law.predict_samples(r, weights) for r in rs])
    band = np.array([law.interval(s) for s in samples])
    ax.plot([p["proportions"][name] for p in record["proxies"]], [p["target"] for p in record["proxies"]], "ko",
            ms=4, label="proxies (measured)")
    ax.plot(xs, [law.predict(r, weights) for r in rs], "-", color="C0", label="law through the optimum")
    ax.fill_between(xs, band[:, 0], band[:, 1], color="C0", alpha=0.2, label="bootstrap interval")
    opt = record["optimum"]
    ax.errorbar(best[j], opt["predicted"], yerr=figures.interval_bar(opt["predicted"], opt["interval"]), fmt="*",
                color="C3", ms=12, capsize=3, label="optimum")
    lo, hi = record["bounds"][name]
    if lo > 0 or hi < 1:
        ax.axvspan(lo, hi, color="C2", alpha=0.08, label="bound")
    seen = [p["target"] for p in record["proxies"]] + [opt["predicted"]]
    pad = 0.25 * (max(seen) - min(seen)) + 1e-3  # the band far outside the proxies would flatten everything
    ax.set_ylim(min(seen) - pad, max(seen) + pad)
    ax.set(xlabel=f"proportion of {name}", ylabel=f"target loss ({record['target']})", title=f"Target against {name}")
    ax.legend(fontsize=7)


def write_plot(record: dict, law: MixtureLaw, weights: np.ndarray, path: Path) -> None:
    """The figure, saved to ``path``: the held-out panel, then one panel per source."""
    k = len(record["sources"])
    fig, axes = figures.subplots(1, k + 1, figsize=(4.6 * (k + 1), 4.4))
    plot_held_out(axes[0], record)
    for j in range(k):
        plot_source(axes[j + 1], record, law, weights, j)
    figures.save(fig, path, dpi=90)
