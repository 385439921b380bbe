"""The ``mtp`` suite: DeepSeek-V3 debug with and without one multi-token prediction depth, the same
batches, seed and token count; ``mtp_run`` is also the hybrid suite's loss-at-equal-tokens run.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from titan_hydra.bench.common import failure, header_value, launch, metrics_of, run_dir_of, variant_table
from titan_hydra.hardware import cpu_isa, cpu_model


def mtp_run(args, tmp: Path, name: str, overrides: tuple[str, ...], model: str = "deepseek_v3_debug") -> dict:
    """One run of the mtp (or hybrid) suite: validation every steps/4, the next-token CE of the
    training batches (an MTP run's loss minus its weighted MTP term) and tokens/s."""
    run_dir = run_dir_of(tmp, name)
    proc, wall = launch([f"model={model}", *overrides, f"training.steps={args.steps}",
                         f"training.val_freq={max(1, args.steps // 4)}", "training.val_steps=8", "logger=minimal",
                         "checkpoint=none", "cluster.nproc_per_node=1", f"cluster.threads_per_proc={args.threads}",
                         f"hydra.run.dir={run_dir}", *args.extra], args.threads, tmp)
    if proc.returncode != 0:
        return {"variant": name, "failed": failure(proc)}
    rows = metrics_of(run_dir)
    train = [r for r in rows if "loss" in r and "tps" in r]
    weight = 0.3 if any("mtp/loss" in r for r in train) else 0.0
    last = train[-10:]
    return {
        "variant": name, "overrides": list(overrides), "wall_s": wall,
        "val_loss": {r["step"]: r["val/loss"] for r in rows if "val/loss" in r},
        "train_next_token_ce_last10": statistics.mean(r["loss"] - weight * r.get("mtp/loss", 0.0) for r in last),
        "mtp_loss_last10": statistics.mean(r["mtp/loss"] for r in last) if weight else None,
        "tokens_per_s": statistics.median(r["tps"] for r in train if r["step"] > args.warmup),
        "precision": header_value(proc.stdout, "precision").split(" ")[0],
    }


def mtp_suite(args, tmp: Path) -> tuple[list[str], dict]:
    """DeepSeek-V3 debug with and without one multi-token prediction depth (weight 0.3), the same
    batches, seed and token count: validation loss (next-token CE; eval forwards skip MTP) along
    the run, the training batches' next-token CE, and the throughput MTP costs."""
    variants = {"deepseek_v3_debug": ("model.mtp_layers=0",),
                "deepseek_v3_debug + MTP (1 depth, weight 0.3)": ("model.mtp_layers=1",)}
    rows = [mtp_run(args, tmp, name, ov) for name, ov in variants.items()]
    steps = sorted({s for r in rows for s in r.get("val_loss", {})})

    def cells(r: dict) -> str:
        vals = " | ".join(f"{r['val_loss'].get(s, float('nan')):.4f}" for s in steps)
        mtp = "-" if r["mtp_loss_last10"] is None else f"{r['mtp_loss_last10']:.4f}"
        return f"{vals} | {r['train_next_token_ce_last10']:.4f} | {mtp} | {r['tokens_per_s']:,.0f}"

    lines = variant_table(f"suite `mtp` — {time.strftime('%Y-%m-%d')}, {cpu_model()} ({cpu_isa()}), "
                          f"{os.cpu_count()} cores, {args.threads} thread(s), {args.steps} steps of the builtin corpus",
                          [*(f"val loss @{s}" for s in steps), "train next-token CE (last 10)",
                           "mtp/loss (last 10)", "tok/s"], rows, cells)
    return lines, {"suite": "mtp", "steps": args.steps, "rows": rows}
