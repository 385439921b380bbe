"""Qwen3.5 (dense and MoE) trained end to end: the debug flavors' loss falls; every supported layout
on 2 ranks equals the single-process losses (fp32); a run resumed from its step-5 checkpoint
reproduces the uninterrupted one bit for bit. TP and CP are refused in one line (test_qwen3_5.py).

The parity model: BASE's shape (dim 64, 4 layers, 4/2 heads) with head_dim 16, layers
linear / full / linear / full (both mixers on each pipeline stage), Gated DeltaNet 2 key / 4 value
heads x 16 in chunks of 16 (4 chunks per 64-token sequence, so the chunk-to-chunk state acts), and
for the MoE flavor 4 experts of width 32 plus the gated shared expert."""

from __future__ import annotations

import math
import shutil

import pytest

from titan_hydra.spec import spec_of
from helpers import BASE, GLOBAL_BATCH, assert_parity, compose_cfg, run_layout, run_single

HYBRID = ["model.head_dim=16", "model.full_attention_interval=2", "model.linear_num_key_heads=2",
          "model.linear_num_value_heads=4", "model.linear_key_head_dim=16", "model.linear_value_head_dim=16",
          "model.linear_chunk_size=16"]
# family -> (parity overrides after helpers.BASE, {layout name: overrides on 2 ranks}, tolerance per layout)
FAMILIES = {
    "qwen3_5": (["model=qwen3_5_debug", "model.ffn_hidden_dim=96", *HYBRID],
                {"fsdp": ["parallelism=fsdp"], "pp": ["parallelism=pp"],
                 # per-block compile and selective (per-op) activation checkpointing together, as test_perf_layouts
                 "fsdp_compile_ac": ["parallelism=fsdp", "compile=model", "activation_checkpoint=selective_op"]}),
    "qwen3_5_moe": (["model=qwen3_5_moe_debug", *HYBRID, "model.moe.num_experts=4", "model.moe.expert_dim=32"],
                    {"ep": ["parallelism=ep"], "pp": ["parallelism=pp"]}),
}
# compile fuses other kernels than eager (test_perf_layouts.py's COMPILE_ATOL)
ATOL = {"fsdp_compile_ac": 5e-5}
CHECKPOINTS = ["checkpoint=default", "checkpoint.interval=5", "checkpoint.keep_latest_k=0"]
PARITY = [(family, layout) for family, (_, layouts) in FAMILIES.items() for layout in layouts]


def overrides(family: str) -> list[str]:
    return FAMILIES[family][0] + CHECKPOINTS


@pytest.fixture(scope="module")
def singles(tmp_path_factory):
    """family -> (run path, single-process losses), computed on first use."""
    cache: dict[str, tuple] = {}

    def get(family: str):
        if family not in cache:
            path = tmp_path_factory.mktemp(f"{family}_single")
            cache[family] = (path, run_single(path, overrides(family)))
        return cache[family]

    return get


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.slow
def test_debug_flavor_trains_with_falling_loss(tmp_path, family):
    from titan_hydra.train.pretrain import run

    steps = 12
    cfg = compose_cfg([f"model={family}_debug", "logger=minimal", "training.val_freq=0", "cluster.threads_per_proc=1",
                       f"training.steps={steps}", "training.seq_len=128", "training.local_batch_size=4",
                       "data.max_documents=200", "optimizer.lr=2e-3"])
    losses = run(spec_of(cfg), str(tmp_path / "run"))["losses"]
    assert len(losses) == steps and all(math.isfinite(x) for x in losses), losses
    assert math.log(2048) - 0.2 < losses[0] < math.log(2048) + 1.0, losses[0]
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 0.4, (first, last)  # measured: qwen3_5_moe 8.04 -> 7.54 (12 steps)


@pytest.mark.parametrize("family,layout", PARITY, ids=[f"{f}-{layout}" for f, layout in PARITY])
@pytest.mark.slow
def test_layout_loss_parity(tmp_path, singles, family, layout, record_property):
    _, reference = singles(family)
    dp = 1 if layout == "pp" else 2
    losses = run_layout(tmp_path, [*overrides(family), *FAMILIES[family][1][layout]], nproc=2, dp=dp)
    assert_parity(losses, reference, ATOL.get(layout, 1e-5), f"{family} {layout}", record_property)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.slow
def test_exact_resume(singles, tmp_path, capsys, family):
    """Steps 1-5, checkpoint, resume, 6-10 == the uninterrupted 10 steps, bit for bit."""
    from titan_hydra.train.pretrain import run

    path, reference = singles(family)
    shutil.copytree(path / "run" / "checkpoint", tmp_path / "checkpoint")
    shutil.rmtree(tmp_path / "checkpoint" / "step-10")
    cfg = compose_cfg(BASE + overrides(family) + ["cluster.nproc_per_node=1", "parallelism=single",
                                                  f"training.local_batch_size={GLOBAL_BATCH}"])
    capsys.readouterr()
    losses = run(spec_of(cfg), str(tmp_path))["losses"]
    assert f"loaded {tmp_path / 'checkpoint' / 'step-5'}" in capsys.readouterr().out
    assert losses == reference
