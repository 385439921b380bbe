"""A multirun sweep as rows: one ``JobRow`` per job, from its run dir and the launcher's manifest.

Jobs come from the numbered run dirs and from ``jobs.json`` (written by the SLURM launcher before
submission), so a job that failed, or never started, is a ``failed`` row rather than missing. A
job's status is its ``status.json`` (titan_hydra.launch.sweep), else inferred from whether
metrics.jsonl reached ``training.steps``. Rows are labelled by the overrides that differ across
the sweep; a sweep over ``optimizer.lr`` and other keys gives loss-against-LR curves.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from titan_hydra.analysis.runs import EVAL, eval_curves, metric_curves, read_metrics, read_yaml

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
    # in-loop evaluation: "<task>/acc" or "<task>/ppl" -> [(step, eval/<task>/<acc|ppl>)]
    eval_curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def job_overrides(run_dir: Path, manifest_overrides: list[str] | None) -> str:
    """The job's overrides as Hydra saved them, else as the launcher's manifest lists them."""
    return " ".join(read_yaml(run_dir / ".hydra" / "overrides.yaml") or manifest_overrides or [])


def job_row(num: int, run_dir: Path, manifest_overrides: list[str] | None) -> JobRow:
    row = JobRow(job=num, overrides=job_overrides(run_dir, manifest_overrides))
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
    row.eval_curves = eval_curves(metrics)
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


def job_status(run_dir: Path, steps_done: int) -> tuple[str, str]:
    status_file = run_dir / "status.json"
    if status_file.exists():
        record = json.loads(status_file.read_text())
        if record.get("status") == "COMPLETED":
            return "completed", ""
        return "failed", record.get("error", "")
    config = read_yaml(run_dir / ".hydra" / "config.yaml") or {}
    wanted = (config.get("training") or {}).get("steps")
    if wanted and steps_done >= wanted:
        return "completed", ""
    return "failed", f"stopped at step {steps_done}" + (f" of {wanted}" if wanted else "")


def jobs(sweep_dir: Path) -> list[tuple[int, Path, list[str] | None]]:
    """(number, run dir, the manifest's overrides or None) of every job: its numbered dir or its
    line in ``jobs.json``, so a job that never started is listed too."""
    manifest: dict[int, list[str]] = {}
    if (sweep_dir / "jobs.json").exists():
        for job in json.loads((sweep_dir / "jobs.json").read_text()):
            manifest[int(job["num"])] = job["overrides"]
    nums = set(manifest) | {int(p.name) for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()}
    return [(n, sweep_dir / str(n), manifest.get(n)) for n in sorted(nums)]


def collect(sweep_dir: Path) -> list[JobRow]:
    return [job_row(*job) for job in jobs(sweep_dir)]


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


def eval_names(rows: list[JobRow]) -> list[str]:
    """``<task>/acc`` and ``<task>/ppl`` of every task any job evaluated during training."""
    return sorted({n for r in rows for n in r.eval_curves})


def last_eval(row: JobRow, name: str) -> float | None:
    curve = row.eval_curves.get(name)
    return curve[-1][1] if curve else None
