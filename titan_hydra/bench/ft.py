"""The ``ft`` suite: torchft's replica groups against DDP on 2 data-parallel replicas of 1 thread.

DDP, torchft synchronous groups, LocalSGD and DiLoCo meeting every ``--sync-every`` steps, on the
debug model in fp32 with the same global batch and data: validation loss at the meetings (where
the semi-synchronous groups hold the same weights), MB each rank sends per step, tokens/s.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from titan_hydra.bench.common import failure, header_value, launch, metrics_of, run_dir_of, variant_table


def ft_suite(args, tmp: Path) -> tuple[list[str], dict]:
    """2 data-parallel replicas of 1 thread each on the debug model, fp32, the same global batch and
    data: DDP, torchft synchronous groups, LocalSGD and DiLoCo meeting every ``sync_every`` steps.
    Validation runs at meetings, where the semi-synchronous groups hold the same weights."""
    h = args.sync_every
    ft = ("fault_tolerance=torchft", "fault_tolerance.replica_groups=2", "fault_tolerance.min_replicas=2")
    variants = {
        "DDP (2 ranks, no torchft)": ("parallelism=ddp", "cluster.nproc_per_node=2"),
        "torchft synchronous (2 groups)": ft,
        f"torchft LocalSGD every {h}": (*ft, "fault_tolerance.semi_sync=local_sgd", f"fault_tolerance.sync_every={h}"),
        f"torchft DiLoCo every {h} (outer Nesterov 0.7, 0.9)": (
            *ft, "fault_tolerance.semi_sync=diloco", f"fault_tolerance.sync_every={h}"),
    }
    val_freq = 2 * h
    rows = []
    for name, overrides in variants.items():
        run_dir = run_dir_of(tmp, name)
        proc, wall = launch([*overrides, f"training.steps={args.steps}", "training.mixed_precision=fp32",
                             f"training.val_freq={val_freq}", "training.log_freq=1", "logger=minimal", "checkpoint=none",
                             "cluster.threads_per_proc=1", f"hydra.run.dir={run_dir}", *args.extra], 1, tmp)
        if proc.returncode != 0:
            rows.append({"variant": name, "failed": failure(proc)})
            continue
        metrics = metrics_of(run_dir)
        train = [m for m in metrics if "tps" in m]
        params = int(header_value(proc.stdout, "model").split(": ")[1].split(" ")[0].replace(",", ""))
        sent = train[-1].get("ft/sent_mb")
        rows.append({
            "variant": name, "wall_s": wall, "overrides": list(overrides),
            "val_loss": {m["step"]: m["val/loss"] for m in metrics if "val/loss" in m},
            # DDP's gradient allreduce is not counted by torchft: one fp32 gradient per step
            "mb_per_step": (sent / args.steps) if sent is not None else params * 4 / 2**20,
            "mb_measured": sent is not None,
            "tokens_per_s_total": 2 * statistics.median(m["tps"] for m in train if m["step"] > args.warmup),
        })
    steps = sorted({s for r in rows if "val_loss" in r for s in r["val_loss"]})

    def cells(r: dict) -> str:
        vals = " | ".join(f"{r['val_loss'].get(s, float('nan')):.4f}" for s in steps)
        mb = f"{r['mb_per_step']:.3f}" + ("" if r["mb_measured"] else " (computed)")
        return f"{vals} | {mb} | {r['tokens_per_s_total']:,.0f}"

    lines = variant_table(f"suite `ft` — {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, debug model fp32, "
                          f"2 replicas x 1 thread, {args.steps} steps, validation loss at meetings",
                          [*(f"val loss @{s}" for s in steps), "MB sent/step/rank", "tok/s total"], rows, cells)
    return lines, {"suite": "ft", "steps": args.steps, "sync_every": h, "rows": rows}
