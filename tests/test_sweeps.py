"""Multirun sweeps through Hydra's submitit_local launcher: each job one W&B run grouped by
the sweep and named from its overrides, returning its final validation loss, and the sweep
report lists every job with the numbers its metrics.jsonl holds."""

from __future__ import annotations

import json
import sys

import pytest

from helpers import REPO, run_launch, series
from titan_hydra.metrics.wandb_reader import read_offline_run

pytestmark = pytest.mark.slow

TINY = [
    "model.dim=64", "model.n_layers=2", "model.n_heads=4", "training.seq_len=64", "training.steps=3",
    "training.local_batch_size=4", "training.val_freq=3", "training.val_steps=1",
    "lr_scheduler.warmup_steps=1", "data.max_documents=60", "cluster.threads_per_proc=1",
    "logger.tensorboard=null",
]


def test_submitit_local_sweep_grouped_and_reported(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_launch(["-m", "hydra/launcher=submitit_local", *TINY, "optimizer.lr=1e-3,3e-3",
                       f"hydra.sweep.dir={sweep}"], cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]

    runs = [read_offline_run(sweep / str(n)) for n in (0, 1)]
    assert runs[0]["run"]["group"] == runs[1]["run"]["group"] == "sweep-" + f"{tmp_path.name}_sweep"
    assert "optimizer.lr=0.001" in runs[0]["run"]["name"] and "optimizer.lr=0.003" in runs[1]["run"]["name"]
    assert all("sweep" in r["run"]["tags"] for r in runs)

    sys.path.insert(0, str(REPO / "recipes"))
    import sweep_report

    rows = sweep_report.report(sweep)
    assert [(r.job, r.status) for r in rows] == [(0, "completed"), (1, "completed")]
    for row in rows:
        status = json.loads((sweep / str(row.job) / "status.json").read_text())
        assert status["return_value"] == pytest.approx(row.val_loss, abs=0)  # what a sweeper minimizes
        assert row.final_loss == series(sweep / str(row.job), "loss")[-1]
        assert runs[row.job]["summary"]["loss"] == pytest.approx(row.final_loss, abs=1e-6)
    assert rows[0].final_loss != rows[1].final_loss


def test_report_lists_failed_job_as_failed(tmp_path):
    """A job that stopped early (and one that never started) are failed rows, not dropped."""
    sweep = tmp_path / "sweep"
    (sweep / "0" / ".hydra").mkdir(parents=True)
    (sweep / "0" / ".hydra" / "config.yaml").write_text("training:\n  steps: 5\n")
    (sweep / "0" / ".hydra" / "overrides.yaml").write_text("- optimizer.lr=0.1\n")
    (sweep / "0" / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "loss": 8.5, "tps": 100.0, "mfu": 1.0, "memory_peak_gib": 0.5}) + "\n"
        + json.dumps({"step": 2, "loss": 8.25, "tps": 300.0, "mfu": 3.0, "memory_peak_gib": 0.75}) + "\n")
    (sweep / "jobs.json").write_text(json.dumps([{"num": 0, "overrides": ["optimizer.lr=0.1"]},
                                                 {"num": 1, "overrides": ["optimizer.lr=0.2"]}]))
    sys.path.insert(0, str(REPO / "recipes"))
    import sweep_report

    rows = sweep_report.report(sweep)
    assert [(r.job, r.status, r.steps) for r in rows] == [(0, "failed", 2), (1, "failed", 0)]
    assert rows[0].final_loss == 8.25 and rows[0].tok_per_s == 300.0 and rows[0].peak_mem_gib == 0.75
    assert rows[1].error == "never started (no run dir)"
    csv_lines = (sweep / "report.csv").read_text().splitlines()
    assert len(csv_lines) == 3 and csv_lines[2].startswith("1,optimizer.lr=0.2,optimizer.lr=0.2,failed")


def test_report_labels_jobs_by_what_varies(tmp_path):
    """Table cells and legend entries name the swept keys only; the CSV keeps every override."""
    sys.path.insert(0, str(REPO / "recipes"))
    import sweep_report

    fixed = "model=qwen3_debug cluster=slurm_local training.steps=20 data.max_documents=200"
    rows = [sweep_report.JobRow(job=i, overrides=f"{fixed} optimizer.lr={lr} parallelism={p}")
            for i, (lr, p) in enumerate([("1e-4", "fsdp"), ("3e-4", "fsdp"), ("1e-4", "tp")])]
    rows.append(sweep_report.JobRow(job=3, overrides=f"{fixed} optimizer.lr=1e-4"))  # a default left out
    sweep_report.label_rows(rows)
    assert [r.label for r in rows] == ["optimizer.lr=1e-4 parallelism=fsdp", "optimizer.lr=3e-4 parallelism=fsdp",
                                       "optimizer.lr=1e-4 parallelism=tp", "optimizer.lr=1e-4 ~parallelism"]
    sweep_report.write_tables(rows, tmp_path)
    table = (tmp_path / "report.md").read_text()
    assert "| 1 | `optimizer.lr=3e-4 parallelism=fsdp` |" in table and "cluster=slurm_local" not in table
    assert "cluster=slurm_local" in (tmp_path / "report.csv").read_text()
