"""A sweep's report, written into its multirun dir: ``report.md`` / ``report.csv`` (one row per job:
overrides, final loss, validation loss, tok/s, MFU, peak memory, status) and the figures; for a
sweep of dry runs, one row per layout (memory per rank, fits, collectives, estimated tokens/s) and
no figures (``layout_sweep.py``).

``loss_curves.png`` and ``throughput.png`` always; a sweep over a data mixture's weights adds each
source's validation loss (``val/<name>/loss``) as columns and ``source_val_curves.png``; a sweep
over ``optimizer.lr`` and other keys adds the loss against the LR, one curve per value of the other
keys, with each curve's best LR (a table and ``loss_vs_lr.png``); a run that scores its pictures
(``eval=fidelity``) adds each ``val/fidelity/<what>`` as columns and ``fidelity_curves.png``; a
sweep of cooldown branches adds ``anneal_branches.png`` (titan_hydra/analysis/anneal.py); jobs that
evaluated during training (``eval.freq``, ``eval.suite``) add each task's last ``eval/<task>/acc``
and ``eval/<task>/ppl`` as columns and ``eval_curves.png``.
"""

from __future__ import annotations

import csv
from dataclasses import asdict
from pathlib import Path
from typing import Any

from titan_hydra.analysis import figures
from titan_hydra.analysis.anneal import plot_anneal
from titan_hydra.analysis.layout_sweep import LayoutRow, collect_layouts, is_dry_run_sweep, write_layout_tables
from titan_hydra.analysis.sweep import (COLUMNS, EVAL, FIDELITY, LR, JobRow, collect, eval_names, fidelity_names,
                                        label_rows, last_eval, last_fidelity, last_source_val, lr_curves, source_names)
from titan_hydra.errors import UserError


def lr_table(curves: dict[str, list[tuple[float, float]]]) -> list[str]:
    """Markdown: one row per curve, its loss at every LR of the sweep and its best LR."""
    lrs = sorted({lr for c in curves.values() for lr, _ in c})
    lines = [f"## Loss vs {LR}", "", "| | " + " | ".join(f"{lr:g}" for lr in lrs) + " | best lr |",
             "|---|" + "---:|" * (len(lrs) + 1)]
    for group, curve in curves.items():
        at = dict(curve)
        best = min(curve, key=lambda c: c[1])[0]
        cells = [f"**{at[lr]:.4f}**" if lr == best else _fmt(at.get(lr), ".4f") for lr in lrs]
        lines.append(f"| `{group}` | " + " | ".join(cells) + f" | {best:g} |")
    return lines + ["", "![loss vs learning rate](loss_vs_lr.png)", ""]


def plot_lr_curves(curves: dict[str, list[tuple[float, float]]], path: Path) -> None:
    fig, ax = figures.subplots(figsize=(7, 5))
    for i, (group, curve) in enumerate(curves.items()):
        ax.plot(*zip(*curve), marker="o", color=f"C{i}", label=group[:60])
        ax.plot(*min(curve, key=lambda c: c[1]), marker="*", markersize=14, color=f"C{i}")
    ax.set_xscale("log")
    ax.set_xlabel(f"{LR} (star: each curve's best)")
    ax.set_ylabel("validation loss (else final training loss)")
    ax.set_title("Loss vs learning rate")
    ax.legend(fontsize=7)
    figures.save(fig, path)


def _fmt(value: Any, spec: str) -> str:
    return "" if value is None else format(value, spec)


def write_tables(rows: list[JobRow], sweep_dir: Path) -> None:
    sources, fidelity, evals = source_names(rows), fidelity_names(rows), eval_names(rows)
    with open(sweep_dir / "report.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS + [f"val_loss/{n}" for n in sources]
                                + [FIDELITY + n for n in fidelity] + [EVAL + n for n in evals])
        writer.writeheader()
        for r in rows:
            writer.writerow({**{k: v for k, v in asdict(r).items() if k in COLUMNS},
                             **{f"val_loss/{n}": last_source_val(r, n) for n in sources},
                             **{FIDELITY + n: last_fidelity(r, n) for n in fidelity},
                             **{EVAL + n: last_eval(r, n) for n in evals}})
    lines = [
        f"# Sweep report: {sweep_dir}",
        "",
        f"{sum(r.status == 'completed' for r in rows)} of {len(rows)} jobs completed.",
        "",
        "| job | varies | status | final loss | val loss | " + "".join(f"val {n} | " for n in sources)
        + "".join(f"fidelity {n} | " for n in fidelity) + "".join(f"{n} | " for n in evals)
        + "tok/s | MFU % | peak mem GiB | steps | skipped | rollbacks |",
        "|---:|---|---|---:|---:|" + "---:|" * (len(sources) + len(fidelity) + len(evals)) + "---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        status = r.status if not r.error else f"{r.status}: {r.error}".replace("|", "/")
        lines.append(
            f"| {r.job} | `{r.label}` | {status} | {_fmt(r.final_loss, '.4f')} | {_fmt(r.val_loss, '.4f')} | "
            + "".join(f"{_fmt(last_source_val(r, n), '.4f')} | " for n in sources)
            + "".join(f"{_fmt(last_fidelity(r, n), '.3f')} | " for n in fidelity)
            + "".join(f"{_fmt(last_eval(r, n), '.4f')} | " for n in evals)
            + f"{_fmt(r.tok_per_s, ',.0f')} | {_fmt(r.mfu_pct, '.2f')} | {_fmt(r.peak_mem_gib, '.2f')} | {r.steps} | "
            f"{r.skipped} | {r.rollbacks} |"
        )
    lines += ["", "![loss curves](loss_curves.png)", "", "![throughput](throughput.png)", ""]
    if sources:
        lines += ["![validation loss per data source](source_val_curves.png)", ""]
    curves = lr_curves(rows)
    if curves:
        lines += lr_table(curves)
    if fidelity:
        lines += ["![held-out caption fidelity](fidelity_curves.png)", ""]
    if evals:
        lines += ["![in-loop evaluation per task](eval_curves.png)", ""]
    (sweep_dir / "report.md").write_text("\n".join(lines))


def write_plots(rows: list[JobRow], sweep_dir: Path) -> None:
    plot_losses(rows, sweep_dir / "loss_curves.png")
    sources = source_names(rows)
    if sources:  # a mixture sweep: each source's held-out loss, one panel per source
        curve_panels([{n: r.source_curves.get(n, []) for n in sources} for r in rows], rows,
                     sweep_dir / "source_val_curves.png", "Validation loss on {}", "val/{}/loss", width=5, height=4)
    curves = lr_curves(rows)
    if curves:
        plot_lr_curves(curves, sweep_dir / "loss_vs_lr.png")
    fidelity = fidelity_names(rows)
    if fidelity:
        curve_panels([{n: r.fidelity_curves.get(n, []) for n in fidelity} for r in rows], rows,
                     sweep_dir / "fidelity_curves.png", FIDELITY + "{}")
    evals = eval_names(rows)
    if evals:
        curve_panels([{n: r.eval_curves.get(n, []) for n in evals} for r in rows], rows,
                     sweep_dir / "eval_curves.png", EVAL + "{}")
    plot_throughput(rows, sweep_dir / "throughput.png")


def plot_losses(rows: list[JobRow], path: Path) -> None:
    fig, ax = figures.subplots(figsize=(8, 5))
    for r in rows:
        if r.curve:
            ax.plot(*zip(*r.curve), label=f"#{r.job} {r.label}"[:60], linestyle="-" if r.status == "completed" else ":")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("Loss curves")
    if any(r.curve for r in rows):
        ax.legend(fontsize=7)
    figures.save(fig, path)


def plot_throughput(rows: list[JobRow], path: Path) -> None:
    fig, ax = figures.subplots(figsize=(8, 4))
    labels = [f"#{r.job}" for r in rows]
    ax.bar(labels, [r.tok_per_s or 0.0 for r in rows], color=["C0" if r.status == "completed" else "C3" for r in rows])
    ax.set_ylabel("tokens / s (mean after step 1)")
    ax.set_title("Throughput per job (red: failed)")
    figures.save(fig, path)


def curve_panels(curves: list[dict[str, list[tuple[int, float]]]], rows: list[JobRow], path: Path, title: str,
                 ylabel: str | None = None, width: float = 4, height: float = 3.5) -> None:
    """One panel per metric name (``title`` / ``ylabel`` formatted with it), a line per job
    (``curves[i]`` is job ``rows[i]``'s)."""
    names = sorted({n for c in curves for n in c})
    fig, axes = figures.subplots(1, len(names), figsize=(width * len(names), height), squeeze=False)
    for ax, name in zip(axes[0], names):
        for r, c in zip(rows, curves):
            if c.get(name):
                ax.plot(*zip(*c[name]), marker="o", label=f"#{r.job} {r.label}"[:60])
        ax.set_xlabel("step")
        if ylabel:
            ax.set_ylabel(ylabel.format(name))
            ax.set_title(title.format(name))
            ax.legend(fontsize=7)
        else:
            ax.set_title(title.format(name), fontsize=9)
            ax.legend(fontsize=6)
    figures.save(fig, path)


def report(sweep_dir: Path) -> list[JobRow] | list[LayoutRow]:
    """Read the sweep in ``sweep_dir`` and write its report there; its rows. A sweep of dry runs
    (``dry_run=true`` / ``simulate``: layouts, not trainings) gets a row per layout instead
    (``layout_sweep.py``): its memory per rank, fit, collectives and estimated tokens/s."""
    if not sweep_dir.is_dir():
        raise UserError(f"{sweep_dir} is not a directory")
    if is_dry_run_sweep(sweep_dir):
        layouts = collect_layouts(sweep_dir)
        label_rows(layouts)
        write_layout_tables(layouts, sweep_dir)
        return layouts
    rows = collect(sweep_dir)
    if not rows:
        raise UserError(f"no jobs found in {sweep_dir}")
    label_rows(rows)
    write_tables(rows, sweep_dir)
    write_plots(rows, sweep_dir)
    plot_anneal(sweep_dir, sweep_dir / "anneal_branches.png")
    if (sweep_dir / "anneal_branches.png").exists():
        with open(sweep_dir / "report.md", "a") as f:
            f.write("\n![validation loss against tokens: the anneal branches](anneal_branches.png)\n")
    return rows
