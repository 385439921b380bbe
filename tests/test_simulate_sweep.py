"""A -m sweep of dry runs: one report row per layout, whose numbers are each job's own
(simulation.json) and the planner's (computed here from the same config), and whose refused
layouts are rows carrying the launch's one-line error instead of stopping the sweep."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from helpers import compose_cfg, run_launch
from titan_hydra.analysis import sweep_report
from titan_hydra.errors import UserError
from titan_hydra.launch.resolve import resolved_spec
from titan_hydra.planner.auto import estimated_step_time
from titan_hydra.planner.plan import plan
from titan_hydra.validate import check_spec

GIB = 1024**3
# 2 CPU ranks: fsdp over both (one simulated rank), 2 pipeline stages (two), 3 stages (refused)
SIM = ["dry_run=simulate", "model=llama3_debug", "cluster.nproc_per_node=2", "parallelism=3d", "parallelism.tp=1",
       "parallelism.pp_schedule=1F1B"]  # the attention kernel left to auto: each simulated rank picks its own
# the 405B grid on 64 H100 nodes, planned only (a SLURM cluster: the sweep runs here)
PLAN = ["dry_run=true", "model=llama3_405b", "cluster=slurm_h100", "cluster.nnodes=64", "parallelism=3d",
        "parallelism.tp=8"]


def planner_figures(point: list[str]) -> tuple[int, float, float | None]:
    """(peak bytes per rank, est. tokens/s, usable GiB) from the planner, for one sweep point."""
    spec = check_spec(resolved_spec(compose_cfg(point)), environment=False)
    p = plan(spec)
    return int(p.mem_total_gib * GIB), p.tokens_per_step / estimated_step_time(spec, p), p.usable_memory_gib


def refusal(point: list[str]) -> str:
    """What the launch says of a layout it refuses (its first line), computed in this process."""
    with pytest.raises(UserError) as e:
        check_spec(resolved_spec(compose_cfg(point)), environment=False)
    return str(e.value).splitlines()[0]


def csv_rows(sweep: Path) -> list[dict]:
    with open(sweep / "report.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow  # each simulated rank is a spawned process
@pytest.mark.extended
def test_simulate_sweep_reports_each_layout(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_launch(["-m", *SIM, "parallelism.pp=1,2,3", f"hydra.sweep.dir={sweep}"], cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"# Sweep report: {sweep}" in proc.stdout  # printed when the sweep ends
    assert (sweep / "report.md").exists()

    rows = sweep_report.report(sweep)  # what recipes/sweep_report.py writes: the same table
    assert [(r.job, r.label, r.status) for r in rows] == [
        (0, "parallelism.pp=1", "ok"), (1, "parallelism.pp=2", "ok"), (2, "parallelism.pp=3", "refused")]
    for row, pp in zip(rows[:2], (1, 2)):
        sim = json.loads((sweep / str(row.job) / "simulation.json").read_text())
        assert len(sim["ranks"]) == pp  # one simulated rank per pipeline stage
        tightest = max(sim["ranks"], key=lambda r: r["peak_bytes"])
        assert (row.tightest_rank, row.peak_bytes) == (tightest["rank"], tightest["peak_bytes"])
        peak, tokens_per_s, usable = planner_figures([*SIM, f"parallelism.pp={pp}"])
        assert row.plan_peak_bytes == peak == tightest["estimate_peak_bytes"]
        assert row.est_tokens_per_s == pytest.approx(tokens_per_s, rel=1e-12)
        assert usable is None and row.usable_bytes is None and row.fits is True  # a CPU cluster: no limit
        per_rank: dict[int, dict[str, int]] = {}  # bytes per mesh dim of each simulated rank
        for c in sim["collectives"]:
            per_rank.setdefault(c["rank"], {}).setdefault(c["mesh_dim"], 0)
            per_rank[c["rank"]][c["mesh_dim"]] += c["bytes"]
        assert len(per_rank) == pp
        assert row.collective_bytes == max(per_rank.values(), key=lambda dims: sum(dims.values()))
    # FSDP over both ranks gathers and reduces over dp_shard only; two stages only send and receive
    assert set(rows[0].collective_bytes) == {"dp_shard"} and rows[0].collective_bytes["dp_shard"] > 0
    assert set(rows[1].collective_bytes) == {"pp"} and rows[1].collective_bytes["pp"] > 0
    assert rows[1].peak_bytes < rows[0].peak_bytes  # half the blocks per rank
    assert rows[1].est_tokens_per_s < rows[0].est_tokens_per_s  # the pipeline bubble
    assert rows[2].error == refusal([*SIM, "parallelism.pp=3"])
    assert not (sweep / "2" / "simulation.json").exists()

    table = csv_rows(sweep)
    assert [int(t["peak_bytes"] or 0) for t in table] == [rows[0].peak_bytes, rows[1].peak_bytes, 0]
    assert table[2]["status"] == "refused" and table[2]["error"] == rows[2].error
    assert int(table[1]["collective_bytes/pp"]) == int(table[1]["collective_bytes/total"]) == rows[1].collective_bytes["pp"]
    assert f"| 2 | `parallelism.pp=3` |  | refused: {rows[2].error} |" in (sweep / "report.md").read_text()


@pytest.mark.slow  # a launch.py multirun process
@pytest.mark.extended
def test_plan_sweep_on_a_slurm_cluster_runs_here(tmp_path):
    """dry_run=true over a SLURM cluster: nothing is submitted (this machine has no SLURM to
    answer), each layout is planned here; the layout whose micro-batches do not divide the batch
    is a refused row."""
    sweep = tmp_path / "sweep"
    proc = run_launch(["-m", *PLAN, "parallelism.pp=4,8", f"hydra.sweep.dir={sweep}"], cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = sweep_report.report(sweep)
    assert [(r.status, r.simulated) for r in rows] == [("ok", False), ("refused", False)]
    peak, tokens_per_s, usable = planner_figures([*PLAN, "parallelism.pp=4"])
    assert rows[0].plan_peak_bytes == peak and rows[0].est_tokens_per_s == pytest.approx(tokens_per_s, rel=1e-12)
    assert rows[0].usable_bytes == pytest.approx(usable * GIB, rel=1e-12)
    assert rows[0].fits is (peak <= usable * GIB)
    assert rows[0].layout == "dp_replicate=1 dp_shard=16 tp=8 pp=4 cp=1"
    assert rows[1].error == refusal([*PLAN, "parallelism.pp=8"])


def write(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))


def test_layout_rows_from_the_jobs_files(tmp_path):
    """The table from hand-written job files: the tightest rank's peak, the busiest rank's
    collectives per mesh dim, the fit against the usable memory, a refusal and a crash."""
    sweep, mib = tmp_path / "sweep", 1024**2
    plan_record = {"layout": "dp_replicate=1 dp_shard=4 tp=2 pp=2 cp=1", "mem_total_gib": 50.0,
                   "usable_memory_gib": 60.0, "step_time_s_at_mfu40": 2.0, "estimated_step_time_s": 2.5,
                   "estimated_tokens_per_s": 4000.0}
    coll = [{"rank": 0, "stage": 0, "mesh_dim": "tp", "op": "all_gather", "count": 3, "bytes": 300 * mib},
            {"rank": 0, "stage": 0, "mesh_dim": "tp", "op": "all_reduce", "count": 1, "bytes": 50 * mib},
            {"rank": 0, "stage": 0, "mesh_dim": "pp", "op": "send", "count": 2, "bytes": 10 * mib},
            {"rank": 8, "stage": 1, "mesh_dim": "tp", "op": "all_gather", "count": 3, "bytes": 200 * mib},
            {"rank": 8, "stage": 1, "mesh_dim": "dp_shard", "op": "all_gather", "count": 3, "bytes": 400 * mib}]
    ranks = [{"rank": 0, "peak_bytes": 70 * GIB}, {"rank": 8, "peak_bytes": 40 * GIB}]
    for job, over in ((0, "parallelism.tp=2"), (1, "parallelism.tp=3"), (2, "parallelism.tp=4")):
        (sweep / str(job) / ".hydra").mkdir(parents=True)
        (sweep / str(job) / ".hydra" / "overrides.yaml").write_text(f"- dry_run=simulate\n- {over}\n")
    write(sweep / "0" / "plan.json", plan_record)
    write(sweep / "0" / "simulation.json", {"tightest_rank": 0, "ranks": ranks, "collectives": coll,
                                            "usable_bytes": 60.0 * GIB, "fits": False})
    write(sweep / "1" / "refused.json", {"error": "tp=3 does not divide 8 heads"})
    write(sweep / "2" / "status.json", {"status": "FAILED", "error": "RuntimeError: boom"})

    rows = sweep_report.report(sweep)
    assert [(r.label, r.status, r.error) for r in rows] == [
        ("parallelism.tp=2", "ok", ""), ("parallelism.tp=3", "refused", "tp=3 does not divide 8 heads"),
        ("parallelism.tp=4", "failed", "RuntimeError: boom")]
    ok = rows[0]
    assert (ok.peak_bytes, ok.tightest_rank, ok.plan_peak_bytes) == (70 * GIB, 0, 50 * GIB)
    assert ok.fits is False  # the simulated peak decides, not the plan's 50 GiB
    assert ok.collective_bytes == {"dp_shard": 400 * mib, "tp": 200 * mib}  # rank 8 moves 600 MiB, rank 0 360
    table = csv_rows(sweep)
    assert table[0]["collective_bytes/total"] == str(600 * mib) and "collective_bytes/pp" not in table[0]
    assert table[0]["est_tokens_per_s"] == "4000.0" and table[0]["fits"] == "False"
    md = (sweep / "report.md").read_text()
    assert ("| 0 | `parallelism.tp=2` | dp_replicate=1 dp_shard=4 tp=2 pp=2 cp=1 | ok | 70.00 GiB (0) | "
            "50.00 GiB | no (60.0) | 400.0 MiB | 200.0 MiB | 600.0 MiB | 4,000 |") in md
    assert "| 1 | `parallelism.tp=3` |  | refused: tp=3 does not divide 8 heads |" in md
    assert "| 2 | `parallelism.tp=4` |  | failed: RuntimeError: boom |" in md
