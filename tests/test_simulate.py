"""dry_run=simulate: the simulated rank against a real run, and real-size layouts at world >= 64.

Ground truth: the same rank code (``simulate_rank``) runs once on fake tensors under the fake
process group and once for real in a 2-rank gloo group, measured by the same live-storage
tracker; the shards must be the same bytes exactly and the activations within 10%.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from tests.helpers import compose_cfg, spawn_gloo
from titan_hydra.simulate.simulator import simulate
from titan_hydra.validate import validate

DEBUG = ["model=llama3_debug", "cluster.nproc_per_node=2", "training.attention_kernel=sdpa",
         "training.local_batch_size=4", "training.seq_len=128"]


def _real_rank(rank: int, overrides: list[str], out_dir: str) -> None:
    from titan_hydra.simulate.rank import simulate_rank

    spec = validate(compose_cfg(overrides), environment=False)
    result = simulate_rank(spec, rank, 2, torch.device("cpu"), fake_tensors=False)
    row = {k: v for k, v in asdict(result).items() if k.endswith("_bytes")}
    Path(out_dir, f"{rank}.json").write_text(json.dumps(row))


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_simulated_rank_holds_what_the_real_two_rank_run_holds(tmp_path, layout):
    overrides = [*DEBUG, f"parallelism={layout}"]
    if layout == "tp":
        overrides.append("parallelism.tp=2")
    spawn_gloo(_real_rank, 2, overrides, str(tmp_path))
    real = json.loads((tmp_path / "0.json").read_text())
    sim = simulate(validate(compose_cfg(overrides), environment=False)).ranks[0]
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        assert getattr(sim, key) == real[key], key
    assert abs(sim.activations_bytes - real["activations_bytes"]) <= 0.10 * real["activations_bytes"]
    assert abs(sim.peak_bytes - real["peak_bytes"]) <= 0.10 * real["peak_bytes"]
