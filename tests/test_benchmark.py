"""recipes/benchmark.py end to end on a tiny model: every variant runs, and the derived columns
(speedup vs baseline, MFU) are what the raw per-variant numbers say. The report's pieces (a run
header's row, a suite's table with a failed variant) are checked in this process too, for the
fast tier."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from helpers import REPO, TINY


@pytest.mark.slow
@pytest.mark.extended
def test_benchmark_precision_suite_tiny(tmp_path):
    out = tmp_path / "bench.json"
    overrides = [o for o in TINY if not o.startswith("lr_scheduler.")] + ["lr_scheduler.warmup_steps=1"]
    proc = subprocess.run(
        [sys.executable, str(REPO / "recipes" / "benchmark.py"), "--steps=4", "--warmup=1",
         f"--out={out}", *overrides],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    rows = report["results"]
    assert [r["variant"] for r in rows] == ["fp32 eager", "bf16 autocast"]
    assert all(r["status"] == "ok" for r in rows), rows
    base = rows[0]
    assert base["speedup_vs_baseline"] == 1.0
    assert rows[1]["speedup_vs_baseline"] == pytest.approx(rows[1]["tps_total"] / base["tps_total"])
    for r in rows:
        assert r["tps_per_rank"] > 0 and r["peak_memory_gib"] > 0
        assert r["mfu_vs_bf16_peak_pct"] == pytest.approx(100 * r["tflops_per_rank"] / report["peak_bf16_tflops"])
    assert [r["precision"] for r in rows] == ["fp32", "bf16"]  # read back from each run's header
    assert "| fp32 eager | fp32, sdpa | 1x1 |" in report["table"]
    assert "| bf16 autocast | bf16, " in report["table"]
    # Its console is its own lines only (as tests/test_recipe_commands.py asks of every recipe):
    # a progress line per variant and where the JSON went on stderr, the table on stdout.
    progress = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(progress) == 3 and progress[-1] == f"wrote {out}", progress
    assert all(re.fullmatch(r"  (fp32 eager|bf16 autocast): ok \(\d+s\)", line) for line in progress[:2]), progress
    assert proc.stdout.startswith("suite `precision`") and not re.search(r"Warning|warn\(", proc.stdout)


def test_report_reads_the_run_header_and_tabulates_a_failed_variant():
    from titan_hydra.bench import common as benchmark

    stdout = "titan_hydra run\n  precision  fp32 (auto: no native bf16)\n  layout     1x1\nstep 1 | loss 7.1\n"
    assert benchmark.header_value(stdout, "precision") == "fp32 (auto: no native bf16)"
    assert benchmark.header_value(stdout, "attention") == "?"
    rows = [{"variant": "fp32 eager", "tps": 1200.0}, {"variant": "bf16 autocast", "failed": "error: out of memory"}]
    table = benchmark.variant_table("### precision", ["tokens/s"], rows, lambda r: f"{r['tps']:.0f}")
    assert table == ["### precision", "", "| variant | tokens/s |", "|---|---|",
                     "| fp32 eager | 1200 |", "| bf16 autocast | failed: error: out of memory |"]
