"""Loss-parity harness: run a layout end to end through launch.py and read its losses.

Every layout trains the same tiny model, from the same full-model init (training.init_mode=full),
on the same global batches (the loader gives data-parallel ranks disjoint slices of one global
batch), in fp32, so per-step losses must match the single-process run.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from conftest import run_launch

GLOBAL_BATCH = 8
STEPS = 10

BASE = [
    "model.dim=64",
    "model.n_layers=4",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "training.seq_len=64",
    f"training.steps={STEPS}",
    f"training.global_batch_size={GLOBAL_BATCH}",
    "training.mixed_precision=fp32",
    "training.init_mode=full",
    "training.val_freq=0",
    "lr_scheduler.warmup_steps=2",
    "data.max_documents=60",
    "logger=minimal",
    "cluster.threads_per_proc=1",
]


def read_losses(run_dir: Path) -> list[float]:
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    return [r["loss"] for r in rows if "loss" in r]


def run_layout(tmp_path: Path, overrides: list[str], nproc: int, dp: int, timeout: int = 600) -> list[float]:
    """Train one layout with ``nproc`` workers and ``dp`` data-parallel ranks; return losses."""
    run_dir = tmp_path / "run"
    args = BASE + [
        f"cluster.nproc_per_node={nproc}",
        f"training.local_batch_size={GLOBAL_BATCH // dp}",
        f"hydra.run.dir={run_dir}",
        *overrides,
    ]
    proc = run_launch(args, cwd=tmp_path, timeout=timeout)
    assert proc.returncode == 0, f"layout {overrides} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    losses = read_losses(run_dir)
    assert len(losses) == STEPS, losses
    return losses


_REFERENCE: dict[tuple, list[float]] = {}


def reference_losses(tmp_path_factory, extra: tuple[str, ...] = ()) -> list[float]:
    """Single-process losses for the same settings (computed once per settings per session)."""
    if extra not in _REFERENCE:
        path = tmp_path_factory.mktemp("reference")
        _REFERENCE[extra] = run_layout(path, ["parallelism=single", *extra], nproc=1, dp=1)
    return _REFERENCE[extra]


def assert_parity(losses: list[float], reference: list[float], atol: float = 1e-5) -> None:
    diffs = [abs(a - b) for a, b in zip(losses, reference)]
    assert max(diffs) <= atol, f"max |loss - single| = {max(diffs):.3g} > {atol}\nlayout: {losses}\nsingle: {reference}"
