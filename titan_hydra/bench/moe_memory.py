"""The ``moe_memory`` suite: resident memory of a long qwen3_moe_debug run (rank 0's RSS after each
step), the criterion that memory stops growing: the last step within 10% of step 30. bf16 with the
experts' rows bucketed (the CPU default) against the same run unpadded, fp32, and 2 expert-parallel
ranks of 1 thread.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from titan_hydra.bench.common import failure, header_value, launch, metrics_of, run_dir_of, variant_table
from titan_hydra.hardware import cpu_isa, cpu_model


def moe_memory_suite(args, tmp: Path) -> tuple[list[str], dict]:
    """Resident memory (rank 0's RSS after each step) of a long qwen3_moe_debug run, the issue's
    criterion: the last step within 10% of step 30. bf16 with the experts' rows bucketed (the CPU
    default) against the same run unpadded, fp32, and 2 expert-parallel ranks of 1 thread."""
    bf16 = ("model=qwen3_moe_debug", "training.mixed_precision=bf16")
    variants = {
        "bf16, bucketed expert rows (default)": (bf16, 1, args.threads),
        "bf16, unpadded expert rows": ((*bf16, "model.moe.bucket_rows=false"), 1, args.threads),
        "fp32": (("model=qwen3_moe_debug", "training.mixed_precision=fp32"), 1, args.threads),
        "bf16, ep 2 ranks x 1 thread": ((*bf16, "parallelism=ep", "training.local_batch_size=4"), 2, 1),
    }
    if args.variant:
        variants = {k: v for k, v in variants.items() if args.variant in k}
    marks = sorted({1, 30, 100, args.steps} & set(range(1, args.steps + 1)))
    rows = []
    for name, (overrides, nproc, threads) in variants.items():
        run_dir = run_dir_of(tmp, name)
        proc, wall = launch([*overrides, f"training.steps={args.steps}", "training.val_freq=0", "logger=minimal",
                             "checkpoint=none", f"cluster.nproc_per_node={nproc}", f"cluster.threads_per_proc={threads}",
                             f"hydra.run.dir={run_dir}", *args.extra], threads, tmp)
        if proc.returncode != 0:
            rows.append({"variant": name, "failed": failure(proc)})
            continue
        steps = {m["step"]: m for m in metrics_of(run_dir) if "memory_current_gib" in m and "step" in m}
        rss = {s: steps[s]["memory_current_gib"] for s in marks if s in steps}
        rows.append({
            "variant": name, "overrides": list(overrides), "ranks": nproc, "threads": threads, "wall_s": wall,
            "rss_gib": rss, "growth_after_30_pct": 100 * (rss[marks[-1]] / rss[30] - 1) if 30 in rss else None,
            "tokens_per_s_total": nproc * statistics.median(
                m["tps"] for s, m in steps.items() if s > args.warmup and "tps" in m),
            "precision": header_value(proc.stdout, "precision").split(" ")[0],
        })
    def cells(r: dict) -> str:
        rss = " | ".join(f"{r['rss_gib'].get(s, float('nan')):.3f}" for s in marks)
        growth = "-" if r["growth_after_30_pct"] is None else f"{r['growth_after_30_pct']:+.1f}%"
        return f"{rss} | {growth} | {r['tokens_per_s_total']:,.0f}"

    lines = variant_table(f"suite `moe_memory` — {time.strftime('%Y-%m-%d')}, {cpu_model()} ({cpu_isa()}), "
                          f"{os.cpu_count()} cores, qwen3_moe_debug, {args.steps} steps, rank 0's resident memory "
                          "(GiB) after the step",
                          [*(f"RSS @{s}" for s in marks), "growth after step 30", "tok/s total"], rows, cells)
    return lines, {"suite": "moe_memory", "steps": args.steps, "rows": rows}
