"""Shared test helpers: compose configs the way launch.py does, and run launch.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import titan_hydra.config  # noqa: F401  (registers schemas)

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"

# Tiny, fast settings shared by the end-to-end tests (seconds per run on 2 cores).
TINY = [
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "training.seq_len=64",
    "training.local_batch_size=4",
    "lr_scheduler.warmup_steps=2",
    "data.max_documents=200",
]


def compose_cfg(overrides: list[str] | None = None):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides or []))


def run_launch(args: list[str], cwd: Path, timeout: int = 600, env: dict | None = None):
    """Run ``python launch.py ARGS`` in a subprocess; returns CompletedProcess."""
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env["WANDB_SILENT"] = "true"
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, str(REPO / "launch.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )


@pytest.fixture
def compose_config():
    return compose_cfg
