"""Bring your own model: a GPT-2-style model defined in the test tree (tests/byo/tiny_gpt.py) plugs
in through config alone (``hydra.searchpath`` + ``model=tiny_gpt``) and trains under fsdp, tp and
pp on 2 ranks with the single-process losses. Proves the model protocol is enough: the engine
names no family and the test model shares no module name with titan_hydra's decoders."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from helpers import REPO, machine_bound, run_launch, series

BYO = REPO / "tests" / "byo"
STEPS = 6
BASE = [
    f"hydra.searchpath=[file://{BYO / 'conf'}]", "model=tiny_gpt",
    "training.seq_len=64", f"training.steps={STEPS}", "training.global_batch_size=8",
    "training.mixed_precision=fp32", "training.init_mode=full", "training.val_freq=0",
    "lr_scheduler.warmup_steps=2", "data.max_documents=60", "logger=minimal", "cluster.threads_per_proc=1",
]
ENV = {"PYTHONPATH": os.pathsep.join([str(BYO), os.environ.get("PYTHONPATH", "")])}


def train(tmp_path: Path, name: str, overrides: list[str]) -> list[float]:
    run_dir = tmp_path / name
    proc = run_launch(BASE + overrides + [f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=ENV)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return series(run_dir, "loss")


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> list[float]:
    return train(tmp_path_factory.mktemp("byo"), "single", ["training.local_batch_size=8"])


def test_family_counts_what_it_builds():
    sys.path.insert(0, str(BYO))
    try:
        import tiny_gpt
    finally:
        sys.path.remove(str(BYO))
    args = tiny_gpt.TinyGPTArgs(dim=48, n_layers=3, n_heads=4, vocab_size=100, max_seq_len=32)
    with torch.device("meta"):
        model = tiny_gpt.TinyGPT(**vars(args))
    assert sum(p.numel() for p in model.parameters()) == tiny_gpt.FAMILY.shape(args).params


@pytest.mark.slow
@pytest.mark.parametrize("layout,overrides", [
    ("fsdp", ["parallelism=fsdp", "training.local_batch_size=4"]),
    ("tp", ["parallelism=tp", "training.local_batch_size=8"]),
    ("pp", ["parallelism=pp", "training.local_batch_size=8"]),
])
@pytest.mark.gate("pp-overrides2")
def test_byo_model_trains_under_layouts_like_one_process(tmp_path, single, run_cache, layout, overrides):
    assert len(single) == STEPS and single[-1] < single[0]
    losses = train(tmp_path, layout, overrides + ["cluster.nproc_per_node=2"])
    assert max(abs(a - b) for a, b in zip(losses, single)) <= machine_bound(run_cache, single), (losses, single)


@pytest.mark.slow
def test_byo_family_refuses_what_it_cannot_run(tmp_path):
    proc = run_launch(BASE + ["parallelism=cp", "cluster.nproc_per_node=2", f"hydra.run.dir={tmp_path}/cp"],
                      cwd=tmp_path, env=ENV)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: tiny_gpt has learned positions")


@pytest.mark.slow
def test_unknown_family_is_one_line(tmp_path):
    proc = run_launch(["model.family=no_such_pkg.FAMILY"], cwd=tmp_path)
    assert proc.returncode == 2
    assert "model.family='no_such_pkg.FAMILY' is neither a built-in family" in proc.stderr.strip().splitlines()[-1]


def test_checkpoint_view_of_two_stages_has_the_whole_models_names():
    """A rank holding two pipeline stages (V schedules) saves them through one view whose names
    are the whole model's, whatever the family calls its block container (here ``h``)."""
    from titan_hydra.checkpoint import PartsView

    sys.path.insert(0, str(BYO))
    try:
        import tiny_gpt
    finally:
        sys.path.remove(str(BYO))
    model = tiny_gpt.TinyGPT(dim=32, n_layers=4, n_heads=4, vocab_size=64, max_seq_len=16)
    first = tiny_gpt.FAMILY.cut_stage(model, range(0, 1), is_first=True, is_last=False)
    last = tiny_gpt.FAMILY.cut_stage(model, range(3, 4), is_first=False, is_last=True)
    view = PartsView([first, last])
    expected = {k for k in model.state_dict() if not k.startswith(("h.1.", "h.2."))}
    assert set(view.state_dict()) == expected
    assert view.h["3"] is last.h["3"] and view.wte is first.wte


def test_evaluation_during_training_needs_the_family_to_build_a_copy():
    """A family without ``build(args)`` cannot make the full evaluation copy: refused in one line
    before the run starts, while the built-in families (which build) pass the same check."""
    from titan_hydra.errors import ConfigError
    from titan_hydra.models.registry import get_family
    from titan_hydra.config.eval import EvalSettings

    sys.path.insert(0, str(BYO))
    try:
        import tiny_gpt
    finally:
        sys.path.remove(str(BYO))
    assert not tiny_gpt.FAMILY.builds_models() and get_family("llama3").builds_models()
    with pytest.raises(ConfigError, match=r"model family 'tiny_gpt' has no build\(args\)"):
        EvalSettings(freq=5, tasks=["builtin_ppl"]).check(tiny_gpt.FAMILY)
    EvalSettings(freq=0).check(tiny_gpt.FAMILY)  # nothing to evaluate: nothing needed
    EvalSettings(freq=5, tasks=["builtin_ppl"]).check(get_family("llama3"))
