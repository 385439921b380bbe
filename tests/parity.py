"""Loss-parity harness: run a layout end to end through launch.py and read its losses.

Every layout trains the same tiny model, from the same full-model init (training.init_mode=full),
on the same global batches (the loader gives data-parallel ranks disjoint slices of one global
batch), in fp32, so per-step losses must match the single-process run.

Model families: ``family`` picks an entry of FAMILIES (overrides applied after BASE), and the
single-process reference is cached per family. Llama 3 is the default and runs every layout;
Qwen3 runs a chosen few (tests pass ``family="qwen3"``), so the suite's time stays bounded.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from conftest import compose_cfg, run_launch

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


# Model family -> overrides after BASE. BASE's shape (dim 64, 4 layers, 4 heads, 2 kv heads) holds
# for every family; Qwen3 adds what it sets on its own: head_dim 32 (q is 128 wide on a 64-wide
# model, so head_dim really is decoupled from dim/n_heads) and the FFN width. qwen3_debug ties
# its embeddings (model.tie_word_embeddings=true), so its layouts run tied unless a test adds UNTIED.
FAMILIES: dict[str, list[str]] = {
    "llama3": [],
    "qwen3": ["model=qwen3_debug", "model.head_dim=32", "model.ffn_hidden_dim=192"],
}
# Tied embeddings cannot be cut into pipeline stages: PP runs (and their references) untie.
UNTIED = "model.tie_word_embeddings=false"


def read_losses(run_dir: Path) -> list[float]:
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    return [r["loss"] for r in rows if "loss" in r]


def run_layout(tmp_path: Path, overrides: list[str], nproc: int, dp: int, timeout: int = 600,
               family: str = "llama3") -> list[float]:
    """Train one layout of ``family`` with ``nproc`` workers and ``dp`` data-parallel ranks; return losses."""
    run_dir = tmp_path / "run"
    args = BASE + FAMILIES[family] + [
        f"cluster.nproc_per_node={nproc}",
        f"training.local_batch_size={GLOBAL_BATCH // dp}",
        f"hydra.run.dir={run_dir}",
        *overrides,
    ]
    proc = run_launch(args, cwd=tmp_path, timeout=timeout)
    assert proc.returncode == 0, f"{family} layout {overrides} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    losses = read_losses(run_dir)
    assert len(losses) == STEPS, losses
    return losses


def run_single(tmp_path: Path, overrides: list[str], family: str = "llama3") -> list[float]:
    """The single-process run of ``family``, in this process (pretrain.run, the program a launched
    rank runs): bitwise the losses of ``run_layout(..., ["parallelism=single"], 1, 1)`` without
    its ~5 s of process start-up. Writes ``tmp_path/run/metrics.jsonl`` like a launched run."""
    from titan_hydra.train.pretrain import run

    run_dir = tmp_path / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = compose_cfg(BASE + FAMILIES[family] + ["cluster.nproc_per_node=1", "parallelism=single",
                                                 f"training.local_batch_size={GLOBAL_BATCH}", *overrides])
    run(cfg, str(run_dir))
    losses = read_losses(run_dir)
    assert len(losses) == STEPS, losses
    return losses


_REFERENCE: dict[tuple, list[float]] = {}


def reference_losses(tmp_path_factory, extra: tuple[str, ...] = (), family: str = "llama3") -> list[float]:
    """Single-process losses of ``family`` for the same settings (computed once per family and
    settings per session)."""
    key = (family, tuple(extra))
    if key not in _REFERENCE:
        path = tmp_path_factory.mktemp(f"reference_{family}")
        _REFERENCE[key] = run_single(path, list(extra), family=family)
    return _REFERENCE[key]


def max_loss_diff(losses: list[float], reference: list[float]) -> float:
    assert len(losses) == len(reference) > 0, (losses, reference)
    return max(abs(a - b) for a, b in zip(losses, reference))


def assert_parity(losses: list[float], reference: list[float], atol: float = 1e-5, label: str = "") -> float:
    """Assert max |loss - reference| <= atol; print it (``pytest -rP`` shows the measured values)."""
    diff = max_loss_diff(losses, reference)
    print(f"PARITY {label} max |loss - single| = {diff:.3g}")
    assert diff <= atol, f"{label} max |loss - single| = {diff:.3g} > {atol}\nlayout: {losses}\nsingle: {reference}"
    return diff
