"""A sweep of dry runs (``dry_run=true`` / ``simulate``) as rows: one ``LayoutRow`` per job, its
layout's memory per rank, fit, collectives and estimated throughput, and the tables of them.

Each row is read as data from what its job left in its run dir (``titan_hydra/launch/dry_run.py``
writes the files): ``plan.json`` (the closed-form plan with the planner's estimated step time and
tokens/s for that layout), ``simulation.json`` (``dry_run=simulate``: every simulated rank's bytes
and collectives, ``simulate/report.py``) or ``refused.json`` (the launch's one-line refusal of a
layout, which in a sweep is an answer, not a failure). analysis may not import the simulator or
the launcher (pyproject.toml), and needs nothing from them but these numbers.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from titan_hydra.analysis.runs import read_yaml
from titan_hydra.analysis.sweep import job_overrides, jobs

GIB = 1024**3
PLAN, SIMULATION, REFUSED = "plan.json", "simulation.json", "refused.json"
COLUMNS = ["job", "label", "overrides", "layout", "status", "simulated", "peak_bytes", "tightest_rank",
           "plan_peak_bytes", "usable_bytes", "fits", "est_step_s", "est_tokens_per_s", "error"]


@dataclass
class LayoutRow:
    job: int
    overrides: str = ""
    label: str = ""  # the overrides that differ across the sweep (sweep.label_rows)
    layout: str = ""  # the plan's degrees: dp_replicate=.. dp_shard=.. tp=.. pp=.. cp=..
    status: str = "failed"  # ok | refused (the launch's own refusal) | failed (the job did not finish)
    error: str = ""
    simulated: bool = False
    peak_bytes: int | None = None  # the tightest simulated rank's peak
    tightest_rank: int | None = None
    plan_peak_bytes: int | None = None  # the closed-form plan's peak per rank
    usable_bytes: float | None = None  # device memory less headroom (None: a CPU cluster, no limit)
    fits: bool | None = None  # the simulated peak (else the plan's) within usable_bytes
    est_step_s: float | None = None
    est_tokens_per_s: float | None = None
    nominal_peak: bool = False  # the cluster gives no peak FLOP/s: tokens/s at the planner's nominal one
    # bytes per step over each mesh dim, of the simulated rank that moves the most
    collective_bytes: dict[str, int] = field(default_factory=dict)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def is_dry_run_sweep(sweep_dir: Path) -> bool:
    """Its jobs are dry runs: one left a dry run's file, or its saved config says ``dry_run``."""
    for _, run_dir, _ in jobs(sweep_dir):
        if any((run_dir / name).exists() for name in (PLAN, SIMULATION, REFUSED)):
            return True
        config = read_yaml(run_dir / ".hydra" / "config.yaml") or {}
        if str(config.get("dry_run", False)).lower() in ("true", "simulate"):
            return True
    return False


def busiest_collectives(collectives: list[dict]) -> dict[str, int]:
    """Bytes per step per mesh dim of the simulated rank that moves the most bytes in all."""
    per_rank: dict[int, dict[str, int]] = {}
    for c in collectives:
        dims = per_rank.setdefault(int(c["rank"]), {})
        dims[c["mesh_dim"]] = dims.get(c["mesh_dim"], 0) + int(c["bytes"])
    if not per_rank:
        return {}
    return max(per_rank.values(), key=lambda dims: sum(dims.values()))


def layout_row(num: int, run_dir: Path, manifest_overrides: list[str] | None) -> LayoutRow:
    row = LayoutRow(job=num, overrides=job_overrides(run_dir, manifest_overrides))
    refused, plan, sim = (read_json(run_dir / name) for name in (REFUSED, PLAN, SIMULATION))
    if refused is not None:
        row.status, row.error = "refused", refused["error"]
        return row
    if plan is None:
        status = read_json(run_dir / "status.json") or {}
        row.error = status.get("error") or ("never started (no run dir)" if not run_dir.exists()
                                            else f"no {PLAN}: the job did not finish")
        return row
    row.status, row.layout = "ok", plan["layout"]
    row.plan_peak_bytes = int(plan["mem_total_gib"] * GIB)
    usable = plan["usable_memory_gib"]
    row.usable_bytes = None if usable is None else usable * GIB
    row.fits = usable is None or plan["mem_total_gib"] <= usable
    row.est_step_s, row.est_tokens_per_s = plan["estimated_step_time_s"], plan["estimated_tokens_per_s"]
    row.nominal_peak = plan["step_time_s_at_mfu40"] is None
    if sim is not None:
        tightest = next(r for r in sim["ranks"] if r["rank"] == sim["tightest_rank"])
        row.simulated, row.tightest_rank, row.peak_bytes = True, tightest["rank"], tightest["peak_bytes"]
        row.usable_bytes, row.fits = sim["usable_bytes"], sim["fits"]
        row.collective_bytes = busiest_collectives(sim["collectives"])
    return row


def collect_layouts(sweep_dir: Path) -> list[LayoutRow]:
    return [layout_row(*job) for job in jobs(sweep_dir)]


def mesh_dims(rows: list[LayoutRow]) -> list[str]:
    return sorted({d for r in rows for d in r.collective_bytes})


def size(n: float | None) -> str:
    """Bytes for a table cell: GiB from 1 GiB up, else MiB."""
    if n is None:
        return ""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 1024**2:.1f} MiB"


def fits_cell(r: LayoutRow) -> str:
    if r.fits is None:
        return ""
    return ("yes" if r.fits else "no") + (" (no limit)" if r.usable_bytes is None else f" ({r.usable_bytes / GIB:.1f})")


def write_layout_tables(rows: list[LayoutRow], sweep_dir: Path) -> None:
    """report.csv (every figure, bytes exact) and report.md."""
    dims = mesh_dims(rows)
    with open(sweep_dir / "report.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS + [f"collective_bytes/{d}" for d in dims]
                                + ["collective_bytes/total"])
        writer.writeheader()
        for r in rows:
            writer.writerow({**{k: getattr(r, k) for k in COLUMNS},
                             **{f"collective_bytes/{d}": r.collective_bytes.get(d) for d in dims},
                             "collective_bytes/total": sum(r.collective_bytes.values()) if r.simulated else None})
    (sweep_dir / "report.md").write_text("\n".join(markdown(rows, sweep_dir)) + "\n")


def markdown(rows: list[LayoutRow], sweep_dir: Path) -> list[str]:
    """report.md: a row per layout; without a simulation (dry_run=true) the plan's columns only."""
    ok = [r for r in rows if r.status == "ok"]
    simulated = any(r.simulated for r in ok)
    dims = mesh_dims(rows)
    nominal = " (a CPU cluster: at the planner's nominal 1 TFLOP/s peak, for ranking only)" if any(
        r.nominal_peak for r in ok) else ""
    columns: list[tuple[str, str, Callable[[LayoutRow], str]]] = [
        ("job", "---:", lambda r: str(r.job)),
        ("varies", "---", lambda r: f"`{r.label}`"),
        ("layout", "---", lambda r: r.layout),
        ("status", "---", lambda r: r.status if not r.error else f"{r.status}: {r.error}".replace("|", "/")),
    ]
    if simulated:
        columns.append(("peak (rank)", "---:", lambda r: f"{size(r.peak_bytes)} ({r.tightest_rank})" if r.simulated else ""))
    columns += [("planner peak", "---:", lambda r: size(r.plan_peak_bytes)),
                ("fits (usable GiB)", "---", fits_cell)]
    if simulated:
        columns += [(d, "---:", lambda r, d=d: size(r.collective_bytes.get(d))) for d in dims]
        columns.append(("collectives", "---:", lambda r: size(sum(r.collective_bytes.values())) if r.simulated else ""))
    columns.append(("est. tokens/s", "---:", lambda r: "" if r.est_tokens_per_s is None else f"{r.est_tokens_per_s:,.0f}"))
    what = ("Peak: the tightest simulated rank's (its rank in brackets), beside the closed-form plan's. Fits: that "
            "peak within the usable GiB per device (device memory less cluster.memory_headroom). "
            f"{', '.join(dims) or 'Mesh dims'}, collectives: bytes per step over each mesh dim and in all, of the "
            "simulated rank that moves the most. " if simulated else
            "Planner peak: the closed-form plan's per rank. Fits: within the usable GiB per device (device memory "
            "less cluster.memory_headroom). ")
    lines = [
        f"# Sweep report: {sweep_dir}",
        "",
        f"{len(rows)} layouts: {len(ok)} {'simulated' if simulated else 'planned'}, {sum(bool(r.fits) for r in ok)} "
        f"of them fit, {sum(r.status == 'refused' for r in rows)} refused, {sum(r.status == 'failed' for r in rows)} failed.",
        "",
        what + "Est. tokens/s: the planner's ranking estimate (planner/auto.py: compute at 40% MFU, the pipeline "
        f"bubble, exposed TP/CP collectives){nominal}.",
        "",
        "| " + " | ".join(c[0] for c in columns) + " |",
        "|" + "|".join(c[1] for c in columns) + "|",
    ]
    return lines + ["| " + " | ".join(c[2](r) for c in columns) + " |" for r in rows]
