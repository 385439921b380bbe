"""Summarize a multirun sweep: one row per job, loss curves and throughput plots.

    python recipes/sweep_report.py multirun/2025-01-31/12-00-00

Writes into that dir: ``report.md`` and ``report.csv`` (overrides, final loss, validation loss,
tok/s, MFU, peak memory, status) and ``loss_curves.png`` / ``throughput.png`` (matplotlib); a
sweep over a data mixture's weights adds each source's validation loss (``val/<name>/loss``) as
columns and as ``source_val_curves.png``. A sweep over ``optimizer.lr`` and other keys (e.g.
``experiment=mup_transfer``: widths x learning rates) adds the loss against the LR, one curve per
value of the other keys, with each curve's best LR: a table and ``loss_vs_lr.png``. A run that
scores its pictures (``eval=fidelity``) adds each ``val/fidelity/<what>`` (fraction of held-out
captions drawn right) as columns and as ``fidelity_curves.png``. A sweep of cooldown branches
(``experiment=anneal_branches``: ``lr_scheduler=cooldown`` jobs started from a stable run's
checkpoints) adds ``anneal_branches.png``: validation loss against tokens, the stable run's curve
with each branch leaving it.
Jobs come from the numbered run dirs and from ``jobs.json`` (written by the SLURM launcher
before submission), so a job that failed, or never started, is a ``failed`` row rather than
missing. A job's status is its ``status.json`` (titan_hydra.launch.sweep), else inferred from
whether metrics.jsonl reached ``training.steps``.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

COLUMNS = ["job", "label", "overrides", "status", "final_loss", "val_loss", "tok_per_s", "mfu_pct", "peak_mem_gib", "steps", "skipped", "rollbacks",
           "error"]


@dataclass
class JobRow:
    job: int
    overrides: str = ""
    label: str = ""  # the overrides that differ across the sweep (set by label_rows)
    status: str = "failed"
    final_loss: float | None = None
    val_loss: float | None = None
    tok_per_s: float | None = None
    mfu_pct: float | None = None
    peak_mem_gib: float | None = None
    steps: int = 0
    skipped: int = 0  # steps the health group did not apply (non-finite or spiking)
    rollbacks: int = 0  # times it went back to a checkpoint past a bad data window
    error: str = ""
    curve: list[tuple[int, float]] = field(default_factory=list)
    tps_curve: list[float] = field(default_factory=list)
    # a data mixture's sources: name -> [(step, val/<name>/loss)]
    source_curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    # text-to-image fidelity: what -> [(step, val/fidelity/<what>)]
    fidelity_curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)


def _read_yaml(path: Path) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(path)) if path.exists() else None


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a job killed mid-write leaves a partial last line
    return rows


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def job_row(num: int, run_dir: Path, manifest_overrides: list[str] | None) -> JobRow:
    overrides = _read_yaml(run_dir / ".hydra" / "overrides.yaml") or manifest_overrides or []
    row = JobRow(job=num, overrides=" ".join(overrides))
    if not run_dir.exists():
        row.error = "never started (no run dir)"
        return row
    metrics = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in metrics if "loss" in r]
    val = [r for r in metrics if "val/loss" in r]
    row.curve = [(int(r["step"]), float(r["loss"])) for r in train]
    row.tps_curve = [float(r["tps"]) for r in train if r.get("tps") is not None]
    row.steps = max((s for s, _ in row.curve), default=0)
    row.final_loss = train[-1]["loss"] if train else None
    row.val_loss = val[-1]["val/loss"] if val else None
    names = sorted({k[4:-5] for r in val for k in r if k.startswith("val/") and k.endswith("/loss") and k != "val/loss"})
    row.source_curves = {n: [(int(r["step"]), float(r[f"val/{n}/loss"])) for r in val if f"val/{n}/loss" in r]
                         for n in names}
    row.fidelity_curves = metric_curves(metrics, FIDELITY)
    steady = train[1:] or train  # the first step includes warm-up
    row.tok_per_s = _mean([r["tps"] for r in steady if r.get("tps") is not None])
    row.mfu_pct = _mean([r["mfu"] for r in steady if r.get("mfu") is not None])
    peaks = [r.get("memory_peak_gib", r.get("memory")) for r in train]
    row.peak_mem_gib = max((p for p in peaks if p is not None), default=None)
    row.skipped = int(max((r["health/skipped"] for r in metrics if "health/skipped" in r), default=0))
    row.rollbacks = int(max((r["health/rollbacks"] for r in metrics if "health/rollbacks" in r), default=0))
    row.status, row.error = job_status(run_dir, row.steps)
    return row


FIDELITY = "val/fidelity/"


def metric_curves(metrics: list[dict], prefix: str) -> dict[str, list[tuple[int, float]]]:
    """{name: [(step, value)]} of every logged key ``<prefix><name>``."""
    curves: dict[str, list[tuple[int, float]]] = {}
    for r in metrics:
        for key, value in r.items():
            if key.startswith(prefix) and isinstance(value, (int, float)):
                curves.setdefault(key[len(prefix):], []).append((int(r["step"]), float(value)))
    return curves


def job_status(run_dir: Path, steps_done: int) -> tuple[str, str]:
    status_file = run_dir / "status.json"
    if status_file.exists():
        record = json.loads(status_file.read_text())
        if record.get("status") == "COMPLETED":
            return "completed", ""
        return "failed", record.get("error", "")
    config = _read_yaml(run_dir / ".hydra" / "config.yaml") or {}
    wanted = (config.get("training") or {}).get("steps")
    if wanted and steps_done >= wanted:
        return "completed", ""
    return "failed", f"stopped at step {steps_done}" + (f" of {wanted}" if wanted else "")


def collect(sweep_dir: Path) -> list[JobRow]:
    manifest: dict[int, list[str]] = {}
    if (sweep_dir / "jobs.json").exists():
        for job in json.loads((sweep_dir / "jobs.json").read_text()):
            manifest[int(job["num"])] = job["overrides"]
    nums = set(manifest) | {int(p.name) for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()}
    return [job_row(n, sweep_dir / str(n), manifest.get(n)) for n in sorted(nums)]


def parsed_overrides(row: JobRow) -> dict[str, str]:
    return dict(o.split("=", 1) if "=" in o else (o, "") for o in row.overrides.split())


def varying_keys(parsed: list[dict[str, str]]) -> list[str]:
    keys = sorted({k for p in parsed for k in p})
    return [k for k in keys if len({p.get(k) for p in parsed}) > 1]


def label_rows(rows: list[JobRow]) -> None:
    """Label each job by the override keys whose values differ across the sweep.

    Every job repeats the sweep's fixed overrides (model, cluster, tiny shapes, ...); shown in
    full they push the one that varies (``optimizer.lr``) off a table cell or a legend entry.
    The full overrides stay in report.csv.
    """
    parsed = [parsed_overrides(r) for r in rows]
    varying = varying_keys(parsed)
    for r, p in zip(rows, parsed):
        r.label = " ".join(f"{k}={p[k]}" if k in p else f"~{k}" for k in varying) or f"#{r.job}"


LR = "optimizer.lr"


def _number_first(text: str) -> tuple:
    """Sort key: ``model.dim=64`` before ``model.dim=128`` (numbers compared as numbers)."""
    parts = []
    for item in text.split():
        value = item.split("=", 1)[-1]
        try:
            parts.append((0, float(value), item))
        except ValueError:
            parts.append((1, 0.0, item))
    return tuple(parts)


def lr_curves(rows: list[JobRow]) -> dict[str, list[tuple[float, float]]]:
    """{the other varying overrides (e.g. ``model.dim=256``): [(lr, loss)] by lr} over the completed
    jobs of a sweep that varies ``optimizer.lr``; the loss is the validation loss where the job
    logged one, else its final training loss. Empty when the LR does not vary."""
    parsed = [parsed_overrides(r) for r in rows]
    varying = varying_keys(parsed)
    if LR not in varying:
        return {}
    curves: dict[str, list[tuple[float, float]]] = {}
    for r, p in zip(rows, parsed):
        loss = r.val_loss if r.val_loss is not None else r.final_loss
        if r.status != "completed" or loss is None or LR not in p:
            continue
        group = " ".join(f"{k}={p[k]}" for k in varying if k != LR and k in p) or "all"
        curves.setdefault(group, []).append((float(p[LR]), float(loss)))
    return {g: sorted(curves[g]) for g in sorted(curves, key=_number_first)}


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


def plot_lr_curves(curves: dict[str, list[tuple[float, float]]], path: Path, plt) -> None:
    fig, ax = plt.subplots(figsize=(7, 5))
    for i, (group, curve) in enumerate(curves.items()):
        ax.plot(*zip(*curve), marker="o", color=f"C{i}", label=group[:60])
        ax.plot(*min(curve, key=lambda c: c[1]), marker="*", markersize=14, color=f"C{i}")
    ax.set_xscale("log")
    ax.set_xlabel(f"{LR} (star: each curve's best)")
    ax.set_ylabel("validation loss (else final training loss)")
    ax.set_title("Loss vs learning rate")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _fmt(value: Any, spec: str) -> str:
    return "" if value is None else format(value, spec)


def source_names(rows: list[JobRow]) -> list[str]:
    """The data sources any job logged its own validation loss for (mixtures)."""
    return sorted({n for r in rows for n in r.source_curves})


def last_source_val(row: JobRow, name: str) -> float | None:
    curve = row.source_curves.get(name)
    return curve[-1][1] if curve else None


def fidelity_names(rows: list[JobRow]) -> list[str]:
    return sorted({n for r in rows for n in r.fidelity_curves})


def last_fidelity(row: JobRow, name: str) -> float | None:
    curve = row.fidelity_curves.get(name)
    return curve[-1][1] if curve else None


def write_tables(rows: list[JobRow], sweep_dir: Path) -> None:
    sources, fidelity = source_names(rows), fidelity_names(rows)
    with open(sweep_dir / "report.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS + [f"val_loss/{n}" for n in sources]
                                + [FIDELITY + n for n in fidelity])
        writer.writeheader()
        for r in rows:
            writer.writerow({**{k: v for k, v in asdict(r).items() if k in COLUMNS},
                             **{f"val_loss/{n}": last_source_val(r, n) for n in sources},
                             **{FIDELITY + n: last_fidelity(r, n) for n in fidelity}})
    lines = [
        f"# Sweep report: {sweep_dir}",
        "",
        f"{sum(r.status == 'completed' for r in rows)} of {len(rows)} jobs completed.",
        "",
        "| job | varies | status | final loss | val loss | " + "".join(f"val {n} | " for n in sources)
        + "".join(f"fidelity {n} | " for n in fidelity) + "tok/s | MFU % | peak mem GiB | steps | skipped | rollbacks |",
        "|---:|---|---|---:|---:|" + "---:|" * (len(sources) + len(fidelity)) + "---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        status = r.status if not r.error else f"{r.status}: {r.error}".replace("|", "/")
        lines.append(
            f"| {r.job} | `{r.label}` | {status} | {_fmt(r.final_loss, '.4f')} | {_fmt(r.val_loss, '.4f')} | "
            + "".join(f"{_fmt(last_source_val(r, n), '.4f')} | " for n in sources)
            + "".join(f"{_fmt(last_fidelity(r, n), '.3f')} | " for n in fidelity)
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
    (sweep_dir / "report.md").write_text("\n".join(lines))


def write_plots(rows: list[JobRow], sweep_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in rows:
        if r.curve:
            ax.plot(*zip(*r.curve), label=f"#{r.job} {r.label}"[:60], linestyle="-" if r.status == "completed" else ":")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("Loss curves")
    if any(r.curve for r in rows):
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(sweep_dir / "loss_curves.png", dpi=100)
    plt.close(fig)

    sources = source_names(rows)
    if sources:  # a mixture sweep: each source's held-out loss, one panel per source
        fig, axes = plt.subplots(1, len(sources), figsize=(5 * len(sources), 4), squeeze=False)
        for ax, name in zip(axes[0], sources):
            for r in rows:
                if r.source_curves.get(name):
                    ax.plot(*zip(*r.source_curves[name]), marker="o", label=f"#{r.job} {r.label}"[:60])
            ax.set_xlabel("step")
            ax.set_ylabel(f"val/{name}/loss")
            ax.set_title(f"Validation loss on {name}")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(sweep_dir / "source_val_curves.png", dpi=100)
        plt.close(fig)

    curves = lr_curves(rows)
    if curves:
        plot_lr_curves(curves, sweep_dir / "loss_vs_lr.png", plt)
    fidelity = fidelity_names(rows)
    if fidelity:
        curve_panels([{n: r.fidelity_curves.get(n, []) for n in fidelity} for r in rows], rows, FIDELITY,
                     sweep_dir / "fidelity_curves.png")

    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"#{r.job}" for r in rows]
    ax.bar(labels, [r.tok_per_s or 0.0 for r in rows], color=["C0" if r.status == "completed" else "C3" for r in rows])
    ax.set_ylabel("tokens / s (mean after step 1)")
    ax.set_title("Throughput per job (red: failed)")
    fig.tight_layout()
    fig.savefig(sweep_dir / "throughput.png", dpi=100)
    plt.close(fig)


def curve_panels(curves: list[dict[str, list[tuple[int, float]]]], rows: list[JobRow], prefix: str,
                 path: Path) -> None:
    """One panel per metric name, a line per job (``curves[i]`` is job ``rows[i]``'s)."""
    import matplotlib.pyplot as plt

    names = sorted({n for c in curves for n in c})
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.5), squeeze=False)
    for ax, name in zip(axes[0], names):
        for r, c in zip(rows, curves):
            if c.get(name):
                ax.plot(*zip(*c[name]), marker="o", label=f"#{r.job} {r.label}"[:60])
        ax.set_xlabel("step")
        ax.set_title(f"{prefix}{name}", fontsize=9)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------------- anneal branches


def _job_config(run_dir: Path):
    """A run's composed config (``.hydra/config.yaml``), its interpolations resolvable."""
    import titan_hydra.groups  # noqa: F401  (lazy: registers the schemas and resolvers, only for this plot)
    from omegaconf import OmegaConf

    return OmegaConf.load(run_dir / ".hydra" / "config.yaml")


def tokens_per_step(run_dir: Path) -> int:
    """Tokens one optimizer step of the run consumed (global batch x sequence length)."""
    from titan_hydra.spec import spec_of  # lazy, as _job_config

    batch = spec_of(_job_config(run_dir)).batch
    return batch.global_ * batch.seq_len


def val_curve(run_dir: Path) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r["val/loss"])) for r in read_metrics(run_dir / "metrics.jsonl") if "val/loss" in r]


def branch_base(run_dir: Path) -> Path | None:
    """The stable run a cooldown job branched off (its ``checkpoint.initial_load_path``'s run dir)."""
    raw = _read_yaml(run_dir / ".hydra" / "config.yaml") or {}
    if (raw.get("lr_scheduler") or {}).get("name") != "cooldown":  # (read as written: cheap for other sweeps)
        return None
    path = _job_config(run_dir).checkpoint.initial_load_path  # resolved (${th_cooldown_start:...})
    if not path:
        return None
    path = Path(path)
    if not path.is_absolute():  # relative to where the sweep was launched
        hydra = _read_yaml(run_dir / ".hydra" / "hydra.yaml") or {}
        path = Path(((hydra.get("hydra") or {}).get("runtime") or {}).get("cwd") or ".") / path
    return path.parent.parent if path.name.startswith("step-") else path.parent


def anneal_curves(sweep_dir: Path) -> dict[int, list[tuple[int, float]]]:
    """{a branch's last step: its validation curve} over the sweep's cooldown jobs; each curve
    starts at its branch point (the step before the first it logged), where its value is None."""
    out = {}
    for run_dir in sorted(p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()):
        curve = val_curve(run_dir)
        if curve and branch_base(run_dir) is not None:
            first = min(int(r["step"]) for r in read_metrics(run_dir / "metrics.jsonl"))
            out[curve[-1][0]] = [(first - 1, None), *curve]
    return out


def plot_anneal(sweep_dir: Path, path: Path, extra: dict[str, list[tuple[int, float]]] | None = None) -> None:
    """Validation loss against tokens: the stable run, each branch from its branch point, and
    ``extra`` curves (other runs of the same batch, e.g. fully scheduled ones) dashed."""
    import matplotlib.pyplot as plt

    jobs = [p for p in sorted(sweep_dir.iterdir()) if p.is_dir() and p.name.isdigit() and branch_base(p)]
    if not jobs:
        return
    base = branch_base(jobs[0])
    per = tokens_per_step(jobs[0])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    base_curve = val_curve(base) if base.exists() else []
    if base_curve:
        ax.plot([s * per for s, _ in base_curve], [v for _, v in base_curve], "k-", label="stable run", lw=1.5)
    for i, (end, curve) in enumerate(sorted(anneal_curves(sweep_dir).items())):
        pts = [(s, v) for s, v in base_curve if s == curve[0][0]] + curve[1:]  # from the base's point there
        ax.plot([s * per for s, _ in pts], [v for _, v in pts], "-o", color=f"C{i}", ms=3, label=f"cooldown to {end}")
    for i, (label, curve) in enumerate((extra or {}).items()):
        ax.plot([s * per for s, _ in curve], [v for _, v in curve], "--", color=f"C{i}", alpha=0.6, label=label)
    ax.set_xlabel("tokens")
    ax.set_ylabel("validation loss")
    ax.set_title("Anneal branches off one stable run")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(sweep_dir: Path) -> list[JobRow]:
    rows = collect(sweep_dir)
    label_rows(rows)
    write_tables(rows, sweep_dir)
    write_plots(rows, sweep_dir)
    plot_anneal(sweep_dir, sweep_dir / "anneal_branches.png")
    if (sweep_dir / "anneal_branches.png").exists():
        with open(sweep_dir / "report.md", "a") as f:
            f.write("\n![validation loss against tokens: the anneal branches](anneal_branches.png)\n")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path, help="a multirun dir (hydra.sweep.dir)")
    args = parser.parse_args(argv)
    if not args.sweep_dir.is_dir():
        print(f"error: {args.sweep_dir} is not a directory", file=sys.stderr)
        return 2
    rows = report(args.sweep_dir)
    if not rows:
        print(f"error: no jobs found in {args.sweep_dir}", file=sys.stderr)
        return 2
    print((args.sweep_dir / "report.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
