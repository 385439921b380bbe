"""Multirun sweeps through Hydra's submitit_local launcher: each job one W&B run grouped by
the sweep and named from its overrides, returning its final validation loss, and the sweep
report lists every job with the numbers its metrics.jsonl holds. A bad sweep point is refused
before anything runs; a job that fails at run time is one line with its own error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import run_launch, series
from titan_hydra.logger.wandb_reader import read_offline_run


TINY = [
    "model.dim=64", "model.n_layers=2", "model.n_heads=4", "training.seq_len=64", "training.steps=3",
    "training.local_batch_size=4", "training.val_freq=3", "training.val_steps=1",
    "lr_scheduler.warmup_steps=1", "data.max_documents=60", "cluster.threads_per_proc=1",
    "logger.tensorboard=null",
]


@pytest.mark.slow
def test_submitit_local_sweep_grouped_and_reported(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_launch(["-m", "hydra/launcher=submitit_local", *TINY, "optimizer.lr=1e-3,3e-3",
                       f"hydra.sweep.dir={sweep}"], cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]

    runs = [read_offline_run(sweep / str(n)) for n in (0, 1)]
    assert runs[0]["run"]["group"] == runs[1]["run"]["group"] == "sweep-" + f"{tmp_path.name}_sweep"
    assert "optimizer.lr=0.001" in runs[0]["run"]["name"] and "optimizer.lr=0.003" in runs[1]["run"]["name"]
    assert all("sweep" in r["run"]["tags"] for r in runs)

    from titan_hydra.analysis import sweep_report

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
    from titan_hydra.analysis import sweep_report

    rows = sweep_report.report(sweep)
    assert [(r.job, r.status, r.steps) for r in rows] == [(0, "failed", 2), (1, "failed", 0)]
    assert rows[0].final_loss == 8.25 and rows[0].tok_per_s == 300.0 and rows[0].peak_mem_gib == 0.75
    assert rows[1].error == "never started (no run dir)"
    csv_lines = (sweep / "report.csv").read_text().splitlines()
    assert len(csv_lines) == 3 and csv_lines[2].startswith("1,optimizer.lr=0.2,optimizer.lr=0.2,failed")


def test_report_shows_each_data_sources_validation_loss(tmp_path):
    """A sweep over a mixture's weights: val/<source>/loss becomes a column per source (table and
    CSV) and a panel per source in source_val_curves.png."""
    sweep = tmp_path / "sweep"
    for job, (weight, web, code) in enumerate([(0.1, 5.0, 6.0), (0.5, 5.5, 5.2)]):
        run = sweep / str(job)
        (run / ".hydra").mkdir(parents=True)
        (run / ".hydra" / "config.yaml").write_text("training:\n  steps: 4\n")
        (run / ".hydra" / "overrides.yaml").write_text(f"- data.sources.code.weight={weight}\n")
        rows = [{"step": s, "loss": 7.0 - s} for s in range(1, 5)]
        rows += [{"step": s, "val/loss": 6.0, "val/web/loss": web + 4 - s, "val/code/loss": code + 4 - s} for s in (2, 4)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    from titan_hydra.analysis import sweep_report

    rows = sweep_report.report(sweep)
    assert rows[1].source_curves == {"code": [(2, pytest.approx(7.2)), (4, pytest.approx(5.2))],
                                     "web": [(2, 7.5), (4, 5.5)]}
    table = (sweep / "report.md").read_text()
    assert "| val code | val web |" in table and "| 5.2000 | 5.5000 |" in table
    assert (sweep / "source_val_curves.png").stat().st_size > 0 and "source_val_curves.png" in table
    header, first, _ = (sweep / "report.csv").read_text().splitlines()
    assert header.endswith("val_loss/code,val_loss/web") and first.endswith("6.0,5.0")


def test_report_labels_jobs_by_what_varies(tmp_path):
    """Table cells and legend entries name the swept keys only; the CSV keeps every override."""
    from titan_hydra.analysis import sweep as jobs, sweep_report

    fixed = "model=qwen3_debug cluster=slurm_local training.steps=20 data.max_documents=200"
    rows = [jobs.JobRow(job=i, overrides=f"{fixed} optimizer.lr={lr} parallelism={p}")
            for i, (lr, p) in enumerate([("1e-4", "fsdp"), ("3e-4", "fsdp"), ("1e-4", "tp")])]
    rows.append(jobs.JobRow(job=3, overrides=f"{fixed} optimizer.lr=1e-4"))  # a default left out
    jobs.label_rows(rows)
    assert [r.label for r in rows] == ["optimizer.lr=1e-4 parallelism=fsdp", "optimizer.lr=3e-4 parallelism=fsdp",
                                       "optimizer.lr=1e-4 parallelism=tp", "optimizer.lr=1e-4 ~parallelism"]
    sweep_report.write_tables(rows, tmp_path)
    table = (tmp_path / "report.md").read_text()
    assert "| 1 | `optimizer.lr=3e-4 parallelism=fsdp` |" in table and "cluster=slurm_local" not in table
    assert "cluster=slurm_local" in (tmp_path / "report.csv").read_text()


@pytest.mark.slow
def test_bad_sweep_point_is_refused_before_anything_runs(tmp_path):
    """Every point is composed and validated up front: one line naming the bad point, exit 2,
    and not even the sweep dir exists (SweepCheckCallback)."""
    sweep = tmp_path / "sweep"
    proc = run_launch(["-m", "hydra/launcher=submitit_local", *TINY, "optimizer.lr=1e-3,-1",
                       f"hydra.sweep.dir={sweep}"], cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "error: sweep point #1 [optimizer.lr=-1]: optimizer.lr=-1.0 must be > 0; nothing was launched"]
    assert not sweep.exists() and "#0 :" not in proc.stdout

    proc = run_launch(["-m", *TINY, "optimizer=adamw,adamx", f"hydra.sweep.dir={sweep}"], cwd=tmp_path, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("error: sweep point #1 [optimizer=adamx]: In 'config': Could not find "
                               "'optimizer/adamx' (options: adam, adamw"), lines[0]
    assert not sweep.exists()


@pytest.mark.slow
@pytest.mark.extended
def test_failed_jobs_are_one_line_each(tmp_path):
    """Jobs that fail at run time (their data is bad in a way only reading it shows) are one line
    each, with their own error and log; no submitit traceback; status.json and the report say why."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"txt": "no text field"}) + "\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    sweep = tmp_path / "sweep"
    proc = run_launch(["-m", "hydra/launcher=submitit_local", *TINY, "data=json", f"data.path={bad},{empty}",
                       f"hydra.sweep.dir={sweep}"], cwd=tmp_path, timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "UncompletedJobError" not in proc.stderr, proc.stderr[-3000:]
    errors = {
        0: f"bad record in {bad} line 1: missing text field 'text' (set data.text_field=...)",
        1: f"data file {empty} is empty (no text); remove it or point data.path elsewhere",
    }
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 3, proc.stderr
    for num, path in ((0, bad), (1, empty)):
        prefix = f"sweep job #{num} [data.path={path}] failed: {errors[num]} (log: "
        assert lines[num].startswith(prefix) and lines[num].endswith(")"), lines[num]
        log = Path(lines[num][len(prefix):-1])
        assert f"error: {errors[num]}" in log.read_text()  # the log it points to holds that error
        assert json.loads((sweep / str(num) / "status.json").read_text())["error"] == errors[num]
    assert lines[2] == (f"error: 2 of 2 sweep jobs failed (#0, #1, listed above); "
                        f"python recipes/sweep_report.py {sweep} tabulates the sweep")

    from titan_hydra.analysis import sweep_report

    rows = sweep_report.report(sweep)
    assert [(r.job, r.status, r.error) for r in rows] == [(0, "failed", errors[0]), (1, "failed", errors[1])]


def test_crashed_job_reports_its_exception_line(tmp_path):
    """A job that raised (not launch.py's ``error:`` path) is reported by its exception's last line."""
    import submitit

    from titan_hydra.launch.submitit_jobs import failure_of

    executor = submitit.AutoExecutor(folder=str(tmp_path / "%j"), cluster="local")
    executor.update_parameters(timeout_min=2)
    job = executor.submit(int, "not a number")
    job.wait()
    job._results_timeout_s = 1
    result, line = failure_of(job)
    assert result is None and line == "ValueError: invalid literal for int() with base 10: 'not a number'", line
    assert failure_of(executor.submit(int, "42")) == (42, None)


def test_report_draws_loss_against_the_learning_rate_per_width(tmp_path):
    """A widths x learning-rates sweep (experiment=mup_transfer): one curve per width, its best LR
    in the table (the validation loss, else the final training loss; failed jobs left out)."""
    sweep = tmp_path / "sweep"
    grid = [(64, "1e-3", 6.0), (64, "4e-3", 5.5), (128, "1e-3", 5.9), (128, "4e-3", 6.1), (128, "1.6e-2", None)]
    for job, (dim, lr, val) in enumerate(grid):
        run = sweep / str(job)
        (run / ".hydra").mkdir(parents=True)
        (run / ".hydra" / "config.yaml").write_text("training:\n  steps: 2\n")
        (run / ".hydra" / "overrides.yaml").write_text(f"- model.dim={dim}\n- optimizer.lr={lr}\n- experiment=x\n")
        rows = [{"step": s, "loss": 7.0 - s} for s in (1, 2)] + ([{"step": 2, "val/loss": val}] if val else [])
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[: 3 if val else 1]))
    from titan_hydra.analysis import sweep as jobs, sweep_report

    rows = sweep_report.report(sweep)
    assert jobs.lr_curves(rows) == {"model.dim=64": [(1e-3, 6.0), (4e-3, 5.5)],
                                            "model.dim=128": [(1e-3, 5.9), (4e-3, 6.1)]}
    table = (sweep / "report.md").read_text()
    assert "| `model.dim=64` | 6.0000 | **5.5000** | 0.004 |" in table
    assert "| `model.dim=128` | **5.9000** | 6.1000 | 0.001 |" in table
    assert (sweep / "loss_vs_lr.png").stat().st_size > 0
