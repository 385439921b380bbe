"""Running a training suite (``variants.SUITES``): every variant as its own run, measured from its
metrics.jsonl after warm-up steps: tokens/s per rank and in total, achieved TFLOP/s, MFU against
this machine's measured bf16 matmul peak (one yardstick for every variant), peak memory per rank.
Prints the markdown table and writes JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from titan_hydra.bench.common import REPO, failure, header_value, metrics_of, run_dir_of
from titan_hydra.bench.variants import SUITES, Variant
from titan_hydra.hardware import cpu_isa, cpu_model
from titan_hydra.metrics.throughput import device_peak_tflops


def run_variant(name: str, v: Variant, args, workdir: Path) -> dict:
    """One variant run in its own process; its rates (medians after ``args.warmup`` steps), memory and precision."""
    run_dir = run_dir_of(workdir, name)
    threads = v.threads or args.threads
    overrides = [*args.extra, *v.overrides]
    if v.plain:
        cmd = [sys.executable, str(REPO / "recipes" / "plain_loop.py"), f"--steps={args.steps}",
               f"--threads={threads}", f"--run-dir={run_dir}", *overrides]
    else:
        cmd = [
            sys.executable, str(REPO / "launch.py"),
            f"training.steps={args.steps}", "training.val_freq=0", "logger=minimal",
            f"cluster.nproc_per_node={v.nproc}", f"cluster.threads_per_proc={threads}",
            f"hydra.run.dir={run_dir}", *overrides,
        ]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=workdir)
    wall = time.time() - t0
    if proc.returncode != 0:
        return {"variant": name, "nproc": v.nproc, "group": v.group, "status": f"failed: {failure(proc)}", "wall_s": wall}
    rows = metrics_of(run_dir)
    first = next((r for r in rows if "memory_params_gib" in r), {})
    state_gib = first.get("memory_params_gib", 0.0) + first.get("memory_optimizer_gib", 0.0)
    rate_key = "ips" if any("ips" in r for r in rows) else "tps"  # images/s (Flux) or tokens/s
    rows = [r for r in rows if rate_key in r and r["step"] > args.warmup]
    tps = statistics.median(r[rate_key] for r in rows)
    tflops = statistics.median(r["tflops"] for r in rows)
    return {
        "variant": name,
        "group": v.group,
        "nproc": v.nproc,
        "threads_per_proc": threads,
        "status": "ok",
        "unit": "img" if rate_key == "ips" else "tok",
        "tps_per_rank": tps,
        "tps_total": tps * v.nproc,
        "tflops_per_rank": tflops,
        "peak_memory_gib": max(r.get("memory", 0.0) for r in rows),
        "params_optimizer_gib": state_gib,
        "final_loss": rows[-1]["loss"],
        "moe_max_over_mean": (statistics.median(r["moe/max_over_mean"] for r in rows)
                              if "moe/max_over_mean" in rows[-1] else None),
        "precision": "fp32" if v.plain else header_value(proc.stdout, "precision").split(" ")[0],
        "attention": "sdpa" if v.plain else header_value(proc.stdout, "attention").split(" ")[0],
        "wall_s": wall,
        "overrides": overrides,
    }


def run_training_suite(args) -> None:
    """Every variant of ``SUITES[args.suite]`` as a training run; the table against each group's baseline."""
    torch.set_num_threads(args.threads)
    # The trainer's denominator: measured bf16 matmul peak (fp32's where that is faster).
    peak_bf16 = device_peak_tflops("cpu", torch.bfloat16, fresh=True)
    cpu = f"{cpu_model()} ({cpu_isa()})"
    results = []
    with tempfile.TemporaryDirectory(prefix="titan_bench_") as tmp:
        for name, variant in SUITES[args.suite].items():
            r = run_variant(name, variant, args, Path(tmp))
            if r["status"] == "ok":
                # The matmul peak scales with threads (measured: 0.45 -> 0.90 TFLOP/s, 1 -> 2).
                rank_peak = peak_bf16 * r["threads_per_proc"] / args.threads
                r["mfu_vs_bf16_peak_pct"] = 100 * r["tflops_per_rank"] / rank_peak
            results.append(r)
            print(f"  {name}: {r['status']} ({r['wall_s']:.0f}s)", file=sys.stderr, flush=True)
    heading = (f"suite `{args.suite}` — {time.strftime('%Y-%m-%d')}, {cpu}, {os.cpu_count()} cores, "
               f"{args.threads} thread(s)/process unless a variant says, torch {torch.__version__}, bf16 matmul peak "
               f"{peak_bf16:.2f} TFLOP/s/process, {args.steps} steps (median after {args.warmup})")
    table = training_table(heading, results)
    print(table)
    out = Path(args.out or REPO / "bench_out" / f"{args.suite}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "suite": args.suite, "date": time.strftime("%Y-%m-%d"), "cpu": cpu,
        "threads_per_proc": args.threads, "torch": torch.__version__, "peak_bf16_tflops": peak_bf16,
        "steps": args.steps, "warmup": args.warmup, "results": results, "table": table,
    }, indent=2))
    print(f"\nwrote {out}", file=sys.stderr)


def training_table(heading: str, results: list[dict]) -> str:
    """The markdown table of a training suite; sets each row's ``speedup_vs_baseline`` (against
    the first successful variant of its group)."""
    unit = next((r["unit"] for r in results if r["status"] == "ok"), "tok")  # a suite counts one unit
    baselines: dict[str, dict] = {}
    for r in results:
        if r["status"] == "ok":
            baselines.setdefault(r["group"], r)
    lines = [
        heading,
        "",
        f"| variant | precision, attention | ranks x threads | {unit}/s/rank | {unit}/s total | TFLOP/s/rank | MFU (bf16 peak) | peak RSS/rank GiB | params+optim/rank GiB | vs baseline |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    moe = any(r.get("moe_max_over_mean") for r in results)
    if moe:  # MoE suites: one more column, the expert-load imbalance
        lines[-2] += " load max/mean |"
        lines[-1] += "---|"
    for r in results:
        if r["status"] != "ok":
            lines.append(f"| {r['variant']} | | {r['nproc']} | {r['status']} | | | | | | |")
            continue
        ratio = r["tps_total"] / baselines[r["group"]]["tps_total"]
        r["speedup_vs_baseline"] = ratio
        state = f"{r['params_optimizer_gib']:.4f}" if r["params_optimizer_gib"] else "-"  # plain loop: not logged
        lines.append(
            f"| {r['variant']} | {r['precision']}, {r['attention']} | {r['nproc']}x{r['threads_per_proc']} | {r['tps_per_rank']:,.0f} | {r['tps_total']:,.0f} | "
            f"{r['tflops_per_rank']:.3f} | {r['mfu_vs_bf16_peak_pct']:.1f}% | {r['peak_memory_gib']:.2f} | "
            f"{state} | {ratio:.2f}x |" + (f" {r['moe_max_over_mean'] or 0:.2f} |" if moe else "")
        )
    return "\n".join(lines)
