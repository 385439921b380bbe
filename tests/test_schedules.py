"""Batch-size and sequence-length schedules (titan_hydra/schedules.py): the per-step plan against a
hand-computed table, the LR factor's closed forms, the one-line refusals, loss parity of a batch
ramp under fsdp(2) against one process, and bit-for-bit resume inside the ramp and across a
seq-len stage boundary."""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from helpers import BASE, UNTIED, compose_cfg, launch_here, machine_bound, series
from titan_hydra.schedules import lr_factor, schedule_of
from titan_hydra.data.loader import BatchLoader
from titan_hydra.data.staged import StagedLoader
from titan_hydra.errors import ConfigError, DataError
from titan_hydra.spec import spec_of
from titan_hydra.validate import validate

# BASE: global batch 8 x seq_len 64 = 512 tokens per step. The ramp 8 -> 16 -> 24 changes at 1024
# and 3072 tokens: steps 1-2 train 8 sequences, 3-4 16, 5-6 24 (two ramp steps in 6 steps).
RAMP = "training.batch_schedule=[[0,8],[1024,16],[3072,24]]"
RAMP_STEPS = 6
RAMP_BATCHES = [8, 8, 16, 16, 24, 24]


def test_the_step_plan_is_the_hand_computed_table():
    """local 4 x dp 2: accumulation = batch / 8; seq_len 32 until 1024 tokens, then 64."""
    plan = schedule_of(4, 2, 8, 64, [[0, 8], [1024, 16], [3072, 24]], [[0, 32], [1024, 64]], "sqrt")
    # step: (tokens before it, global batch, accumulation, seq_len), walked by hand:
    # 0 +8*32=256 -> 256 +256 -> 512 +256 -> 768 +256 -> 1024 (16 x 64 = 1024 per step) -> 2048 -> 3072 (24 x 64)
    table = [(0, 8, 1, 32), (256, 8, 1, 32), (512, 8, 1, 32), (768, 8, 1, 32), (1024, 16, 2, 64),
             (2048, 16, 2, 64), (3072, 24, 3, 64), (4608, 24, 3, 64)]
    got = [(p.tokens_before, p.global_batch, p.grad_accum, p.seq_len) for p in map(plan.at, range(len(table)))]
    assert got == table
    assert [plan.at(s).lr_factor for s in (0, 4, 6)] == [1.0, math.sqrt(2.0), math.sqrt(3.0)]
    assert (plan.max_global_batch, plan.max_grad_accum) == (24, 3)
    fresh = schedule_of(4, 2, 8, 64, [[0, 8], [1024, 16], [3072, 24]], [[0, 32], [1024, 64]], "sqrt")
    assert fresh.at(7) == plan.at(7)  # a resumed run asks for step 7 first: the same plan


def test_no_schedule_is_the_fixed_plan():
    spec = spec_of(compose_cfg(BASE + ["training.local_batch_size=4"]))
    plan = spec.batch.schedule
    assert not plan.scheduled and spec.batch.global_ == 8 and spec.batch.grad_accum == 2
    assert {plan.at(s) .grad_accum for s in range(5)} == {2} and plan.at(3).tokens_before == 3 * 8 * 64


@pytest.mark.parametrize("rule, expected", [("none", 1.0), ("linear", 3.0), ("sqrt", math.sqrt(3.0))])
def test_lr_factor_closed_forms(rule, expected):
    assert lr_factor(rule, 24, 8) == expected


@pytest.mark.parametrize("target, rule", [("torch.optim.AdamW", "sqrt"), ("torch.optim.SGD", "linear")])
def test_auto_lr_rule_and_the_scheduled_lr(target, rule, tmp_path):
    """auto resolves by optimizer; the LambdaLR's LR of step s is its own multiplier x the factor."""
    opt = ["optimizer=sgd"] if target.endswith("SGD") else []
    spec = spec_of(compose_cfg(BASE + opt + [RAMP, "training.steps=6"]))
    plan = spec.batch.schedule
    assert plan.lr_rule == rule
    p = torch.nn.Parameter(torch.zeros(2))
    optimizers = [torch.optim.SGD([p], lr=1.0) for _ in range(2)]
    plain = spec.lr_scheduler(optimizers[0], 6)
    scaled = spec.lr_scheduler(optimizers[1], 6, plan.step_factor)
    for step in range(6):
        assert scaled.get_last_lr()[0] == plain.get_last_lr()[0] * lr_factor(rule, RAMP_BATCHES[step], 8)
        for optimizer, scheduler in zip(optimizers, (plain, scaled)):
            optimizer.step()  # no gradient: a no-op, in the order LambdaLR expects
            scheduler.step()


@pytest.mark.parametrize("overrides, message", [
    (["training.batch_schedule=[[0,16],[1024,8]]"], r"must increase in both columns: stage \[1024, 8\]"),
    (["training.batch_schedule=[[0,8],[1024,8]]"], r"must increase in both columns"),
    (["training.batch_schedule=[[100,8],[1024,16]]"], r"must start at 0 tokens seen"),
    (["training.batch_schedule=[[0,8],[1024,12]]", "cluster.nproc_per_node=2", "parallelism=fsdp",
      "training.local_batch_size=4"], r"stage \[1024, 12\]: 12 is not a multiple of local_batch_size 4 x "
                                      r"data-parallel degree 2 = 8"),
    (["training.batch_schedule=[[0,8],[1024,16]]", "training.global_batch_size=16"],
     r"training.global_batch_size=16 but training.batch_schedule starts at 8"),
    (["training.seq_len_schedule=[[0,32],[1024,48]]"], r"ends at seq_len 48 but training.seq_len=64"),
    (["training.seq_len_schedule=[[0,32],[1024,64]]", "cluster.nproc_per_node=2", "parallelism=pp",
      "model.tie_word_embeddings=false"], r"not supported with parallelism.pp=2"),
    (["training.seq_len_schedule=[[0,30],[1024,64]]", "cluster.nproc_per_node=2", "parallelism=cp"],
     r"stage seq_len 30 must be divisible by 2\*cp=4"),
    (["training.seq_len_schedule=[[0,32],[1024,64]]", "data=c4"], r"needs packed token data"),
    (["training.batch_schedule=[[0,8],[1024,16]]", "model=flux_debug", "data=flux_shapes"],
     r"batch_schedule counts tokens seen"),
])
def test_bad_schedules_are_refused_in_one_line(overrides, message):
    with pytest.raises(Exception) as info:
        base = [] if any(o.startswith("model=") for o in overrides) else BASE  # BASE's keys are Llama's
        validate(compose_cfg(base + overrides), environment=False)
    text = str(info.value)
    assert isinstance(info.value, (ConfigError, DataError)) and "\n" not in text, text
    assert re.search(message, text), text


def test_a_stage_starts_where_the_tokens_seen_left_off():
    """Entering a stage: ceil(tokens_before / seq_len) windows in (unshuffled: no text read twice)."""
    tokens = torch.arange(10_000).numpy()
    staged = StagedLoader(lambda s: BatchLoader(tokens, s, 2), [16, 64])
    first = [next(staged) for _ in range(3)]  # 6 windows of 16: tokens [0, 96]
    assert int(first[-1][1][-1, -1]) == 96
    staged.select(64, 96)
    inputs, _ = next(staged)
    assert int(inputs[0, 0]) == 128  # ceil(96 / 64) = 2 windows of 64 in: token 128
    state = staged.state_dict()
    other = StagedLoader(lambda s: BatchLoader(tokens, s, 2), [16, 64])
    other.load_state_dict(state)
    assert torch.equal(next(other)[0], next(staged)[0])
    with pytest.raises(DataError, match="saved with seq_len stages"):
        StagedLoader(lambda s: BatchLoader(tokens, s, 2), [32, 64]).load_state_dict(state)


# ----------------------------------------------------------------------------- runs

def _single(run_dir: Path, *extra: str) -> dict:
    from titan_hydra.train.pretrain import run  # as helpers.run_single: in this process

    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = compose_cfg(BASE + ["cluster.nproc_per_node=1", "parallelism=single", "training.local_batch_size=8",
                              f"training.steps={RAMP_STEPS}", *extra])
    return run(spec_of(cfg), str(run_dir), return_state=True)


SEQ = ("training.seq_len_schedule=[[0,32],[1024,64]]", "data.document_mask=true")
SEQ_LENS = [32, 32, 32, 32, 64, 64]
# layout -> (its overrides, the schedule's): fsdp(2) and pp(2) (untied: pipeline stages) through
# the batch ramp, fsdp(2) across the seq-len boundary. Local batch 2 under fsdp accumulates 2, 4,
# then 6 micro-batches per rank where one process accumulates 1, 2, then 3 of 8.
LAYOUTS = {
    "fsdp_ramp": (["parallelism=fsdp", "training.local_batch_size=2"], (RAMP,)),
    "pp_ramp": (["parallelism=pp", "training.local_batch_size=8", UNTIED], (RAMP, UNTIED)),
    "fsdp_seq": (["parallelism=fsdp", "training.local_batch_size=4"], SEQ),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.gate("fsdp_ramp")
def test_scheduled_layout_equals_one_process(layout, run_cache, tmp_path, record_property):
    """The same global batches of the same shapes step by step, so the same losses within the
    machine's measured rounding floor (helpers.machine_bound), and the same logged plan."""
    overrides, schedule = LAYOUTS[layout]
    single = run_cache.once(("schedules_single", *schedule), lambda path: (path, _single(path, *schedule)))
    run_dir = tmp_path / layout
    launch_here(BASE + ["cluster.nproc_per_node=2", f"training.steps={RAMP_STEPS}", *schedule, *overrides], run_dir)
    losses, reference = series(run_dir, "loss"), single[1]["losses"]
    assert series(run_dir, "batch_size") == series(single[0], "batch_size")
    assert series(run_dir, "batch_size") == (RAMP_BATCHES if RAMP in schedule else [8] * RAMP_STEPS)
    if SEQ[0] in schedule:
        assert series(run_dir, "seq_len") == SEQ_LENS
    diff = max(abs(a - b) for a, b in zip(losses, reference))
    bound = machine_bound(run_cache, reference)
    record_property(f"{layout} max |loss - single|", diff)
    record_property(f"{layout} bound", bound)
    assert len(losses) == RAMP_STEPS and diff <= bound, (diff, bound, losses, reference)


@pytest.mark.slow
def test_ramp_starts_as_the_fixed_run(run_cache, tmp_path):
    """Steps 1-2 of the ramp are the fixed batch of 8 at LR factor 1: the run without a schedule,
    bit for bit. (A loss scale left at the runner's built 1/3 would shrink step 1's gradient norm
    3x; the layouts cannot see that, since every layout's count grows by the same ratio.)"""
    ramp_dir, _ = run_cache.once(("schedules_single", RAMP), lambda path: (path, _single(path, RAMP)))
    _single(tmp_path / "fixed")
    for key in ("loss", "grad_norm"):
        assert series(ramp_dir, key)[:2] == series(tmp_path / "fixed", key)[:2], key


def _assert_resume_is_exact(tmp_path: Path, capsys, save_at: int, *extra: str) -> None:
    """Run RAMP_STEPS steps saving every ``save_at``; drop the last checkpoint and resume from
    step ``save_at``: losses and trained weights equal the uninterrupted run's, bit for bit."""
    ckpt = ["checkpoint=default", f"checkpoint.interval={save_at}", "checkpoint.keep_latest_k=0",
            "training.deterministic=true", *extra]
    ref = _single(tmp_path / "ref", *ckpt)
    shutil.copytree(tmp_path / "ref" / "checkpoint", tmp_path / "resumed" / "checkpoint")
    shutil.rmtree(tmp_path / "resumed" / "checkpoint" / f"step-{RAMP_STEPS}")
    capsys.readouterr()
    resumed = _single(tmp_path / "resumed", *ckpt)
    assert f"resuming at step {save_at}" in capsys.readouterr().out  # (a fresh start would match too)
    assert resumed["losses"] == ref["losses"]
    assert resumed["full_state"].keys() == ref["full_state"].keys()
    for key, value in ref["full_state"].items():
        assert torch.equal(resumed["full_state"][key], value), key


@pytest.mark.slow
def test_resume_inside_the_batch_ramp_is_bitwise(tmp_path, capsys):
    """Saved after step 3 (batch 16, the next ramp step at step 5): the resumed run recomputes the
    plan from the step and continues the loader from the saved position."""
    _assert_resume_is_exact(tmp_path, capsys, 3, RAMP)


@pytest.mark.slow
def test_resume_across_a_seq_len_boundary_is_bitwise(tmp_path, capsys):
    """seq_len 32 for 1024 tokens (steps 1-4 of 8 x 32), then 64 with document masking: saved after
    step 3, the resumed run reads step 4 from the restored short-stage position and crosses the
    boundary at step 5, entering the long stage from the tokens seen as the uninterrupted run did."""
    _assert_resume_is_exact(tmp_path, capsys, 3, *SEQ)
    assert series(tmp_path / "ref", "seq_len") == SEQ_LENS
