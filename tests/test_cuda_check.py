"""scripts/cuda_check.py, the one-command CUDA check, stays runnable as the configs change: every
case composes and validates (on CPU here, its GPU overrides swapped for the CPU cluster), and the
parity check compares what it should."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from helpers import compose_cfg
from titan_hydra.validate import validate

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "cuda_check.py"
spec = importlib.util.spec_from_file_location("cuda_check", SCRIPT)
cuda_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cuda_check)


@pytest.mark.parametrize("name", sorted(cuda_check.CASES))
def test_every_case_composes_and_validates(name):
    overrides, steps = cuda_check.CASES[name]
    on_cpu = ["cluster=local_cpu" if o == "cluster=local_gpu" else o for o in overrides
              if o != "cluster.nproc_per_node=1"]
    cfg = compose_cfg([*cuda_check.COMMON, *on_cpu, f"training.steps={steps}"])
    validate(cfg)
    assert cfg.training.steps == steps and cfg.logger.wandb is None


def test_parity_flags_a_gap_and_passes_equal_losses(monkeypatch):
    for cpu, cuda, _ in cuda_check.PARITY:  # the script's own pairs name real cases
        assert cpu in cuda_check.CASES and cuda in cuda_check.CASES
    monkeypatch.setattr(cuda_check, "PARITY", [("a", "b", 1e-4)])
    same = {"a": {"losses": [8.0, 7.5]}, "b": {"losses": [8.0, 7.5 * (1 + 5e-5)]}}
    apart = {"a": {"losses": [8.0, 7.5]}, "b": {"losses": [8.1, 7.5]}}
    missing = {"a": {"losses": [8.0, 7.5]}, "b": {"losses": []}}
    for results, ok in ((same, True), (apart, False), (missing, False)):
        assert [c["ok"] for c in cuda_check.parity(results)] == [ok]
