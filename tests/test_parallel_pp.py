"""Pipeline parallelism: every torch schedule, and PP composed with FSDP / TP, must reproduce
the single-process run step for step (fp32 losses, clipped grad norms and validation loss within
what rounding alone moves them by on this machine: ``helpers.floor_bound`` of the same run
accumulated as 2 x 4 in one process); plus the stage plan and its pre-launch config errors.

All runs clip at max_norm=0.3 (below the ~0.5 natural norm), so every step exercises the
pipeline-group reduction of the grad norm; some schedules also accumulate gradients over
two steps, which checks the loss scaling that replaces torch's ``scale_grads``.

Qwen3 runs ZBVZeroBubble (two stages per rank, V placement) against its own single-process
run, untied: tied embeddings cannot be cut into stages, which launch refuses with one line.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import (BASE, FAMILIES, GLOBAL_BATCH, UNTIED, compose_cfg, param_count, read_metrics, run_launch,
                     run_layout, run_single, series, series_bounds)
from titan_hydra.errors import ConfigError
from titan_hydra.parallel.parallelism import ParallelDims
from titan_hydra.parallel.pp import stage_ids_for_rank, stage_layer_ranges
from titan_hydra.validate import validate

# Validate at step 5 and at the end; clip every step.
COMMON = ["training.val_freq=5", "training.val_steps=2", "training.max_norm=0.3"]
# Per family, what its PP runs (and their single-process reference) add: Qwen3 unties.
PP_MODEL = {"llama3": [], "qwen3": [UNTIED]}


# What each run is compared on: training loss, clipped grad norm, validation loss.
KEYS = ("loss", "grad_norm", "val/loss")


def compared(run_dir: Path) -> dict[str, list[float]]:
    rows = read_metrics(run_dir)
    return {key: series(rows, key) for key in KEYS}


def train(tmp_path: Path, overrides: list[str], nproc: int, dp: int, dp_degree: int = 1,
          family: str = "llama3") -> dict[str, list[float]]:
    """``dp`` sets the local batch (GLOBAL_BATCH // dp); ``dp_degree`` is the layout's real
    data-parallel degree, which decides the validation batch that covers the same sequences."""
    val_bs = f"training.val_local_batch_size={GLOBAL_BATCH // dp_degree}"
    run_layout(tmp_path, COMMON + [val_bs] + PP_MODEL[family] + overrides, nproc=nproc, dp=dp, family=family)
    return compared(tmp_path / "run")


def single_of(run_cache, family: str, local_batch: int = GLOBAL_BATCH) -> dict[str, list[float]]:
    """The family's single-process run with the same settings (once per family per session);
    ``local_batch=GLOBAL_BATCH // 2``: the same run accumulated as 2 x 4, the rounding floor."""
    def compute(path: Path) -> dict[str, list[float]]:
        run_single(path, COMMON + [f"training.val_local_batch_size={GLOBAL_BATCH}"] + PP_MODEL[family]
                   + [f"training.local_batch_size={local_batch}"], family=family)
        return compared(path / "run")

    return run_cache.once(("pp_single", family, local_batch), compute)


def bounds_of(run_cache, family: str) -> dict[str, float]:
    """Per compared series, what rounding alone may move it by (``helpers.series_bounds``)."""
    ref, accumulated = single_of(run_cache, family), single_of(run_cache, family, GLOBAL_BATCH // 2)
    return series_bounds(ref, accumulated, param_count([*BASE, *FAMILIES[family], *PP_MODEL[family]]))


@pytest.fixture
def single(run_cache) -> tuple[dict[str, list[float]], dict[str, float]]:
    return single_of(run_cache, "llama3"), bounds_of(run_cache, "llama3")


def assert_matches(got: dict[str, list[float]], single: tuple[dict[str, list[float]], dict[str, float]],
                   record) -> dict[str, float]:
    """Every compared series within its bound of the single-process run (``single`` = the run and
    its bounds); ``record`` (record_property) keeps the measured max differences in the test report."""
    ref, bounds = single
    diffs = {}
    for key in KEYS:
        assert len(got[key]) == len(ref[key]) > 0, (key, got[key], ref[key])
        diffs[key] = max(abs(a - b) for a, b in zip(got[key], ref[key]))
        record(f"max |{key} - single|", diffs[key])
    assert all(diffs[k] <= bounds[k] for k in KEYS), (
        f"max |layout - single| {diffs} > {bounds}\nlayout: {got}\nsingle: {ref}")
    return diffs


# (schedule, extra overrides, dp argument of run_layout: 2 -> local batch 4 -> 2 accumulation steps)
SCHEDULES = [
    ("GPipe", [], 2),
    ("1F1B", ["parallelism.pp_microbatches=4"], 1),
    ("Interleaved1F1B", [], 2),
    ("LoopedBFS", [], 1),
    ("InterleavedZeroBubble", [], 1),
    ("ZBVZeroBubble", [], 2),
    ("DualPipeV", [], 1),
]


# Llama 3 runs every schedule; Qwen3 the one with two stages per rank (V placement): its own
# blocks (QK-norm, decoupled head_dim) cut at both kinds of stage boundary.
PP_RUNS = [("llama3", *s) for s in SCHEDULES] + [
    ("qwen3", *s) for s in SCHEDULES if s[0] == "ZBVZeroBubble"]


@pytest.mark.parametrize("family,schedule,extra,dp", PP_RUNS, ids=[f"{f}-{s}" for f, s, _, _ in PP_RUNS])
@pytest.mark.slow
@pytest.mark.gate("llama3-1F1B", "llama3-Interleaved1F1B", "llama3-ZBVZeroBubble")
def test_pp_schedule_matches_single(tmp_path, run_cache, record_property, family, schedule, extra, dp):
    got = train(tmp_path, ["parallelism=pp", f"parallelism.pp_schedule={schedule}", *extra], nproc=2, dp=dp,
                family=family)
    assert_matches(got, (single_of(run_cache, family), bounds_of(run_cache, family)), record_property)


@pytest.mark.slow
def test_tied_embeddings_refused_under_pp(tmp_path):
    """qwen3_debug ties its embeddings: launch stops before spawning with exit 2 and one line."""
    run_dir = tmp_path / "run"
    proc = run_launch(BASE + FAMILIES["qwen3"] + ["parallelism=pp", "cluster.nproc_per_node=2",
                                                   f"training.local_batch_size={GLOBAL_BATCH}",
                                                   f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "model.tie_word_embeddings=true" in lines[0] and "pipeline parallel" in lines[0], lines[0]
    assert not (run_dir / "metrics.jsonl").exists()


@pytest.mark.slow
def test_fsdp_pp_matches_single(tmp_path, single, record_property):
    pytest.importorskip("titan_hydra.parallel.fsdp")
    got = train(tmp_path, ["parallelism=fsdp_pp", "parallelism.dp_shard=2"], nproc=4, dp=2, dp_degree=2)
    assert_matches(got, single, record_property)


@pytest.mark.slow
@pytest.mark.extended
def test_tp_pp_matches_single(tmp_path, single, record_property):
    pytest.importorskip("titan_hydra.parallel.tp")
    got = train(tmp_path, ["parallelism=pp", "parallelism.tp=2"], nproc=4, dp=1)
    assert_matches(got, single, record_property)


@pytest.mark.slow  # 8 oversubscribed processes: ~100 s on 2 loaded cores
@pytest.mark.extended
def test_3d_fsdp_tp_pp_matches_single(tmp_path, single, record_property):
    pytest.importorskip("titan_hydra.parallel.fsdp")
    pytest.importorskip("titan_hydra.parallel.tp")
    got = train(tmp_path, ["parallelism=3d"], nproc=8, dp=2, dp_degree=2)
    assert_matches(got, single, record_property)


# --------------------------------------------------------------------------- the plan


def dims(**kw) -> ParallelDims:
    return ParallelDims(world_size=kw.pop("world_size", 2), dp_shard=1, **kw)


def test_default_split_is_even_and_placement_follows_the_schedule():
    assert [list(r) for r in stage_layer_ranges(dims(pp=2, pp_schedule="1F1B"), 6)] == [[0, 1, 2], [3, 4, 5]]
    assert [list(r) for r in stage_layer_ranges(dims(pp=2, pp_schedule="LoopedBFS"), 6)] == [
        [0, 1], [2, 3], [4], [5]]
    split = dims(pp=2, pp_schedule="GPipe", pp_split_points=["layers.1"])
    assert [list(r) for r in stage_layer_ranges(split, 4)] == [[0], [1, 2, 3]]
    lps = dims(pp=2, pp_schedule="Interleaved1F1B", pp_layers_per_stage=1)
    assert len(stage_layer_ranges(lps, 4)) == 4
    assert [stage_ids_for_rank(r, 2, 4, "Interleaved1F1B") for r in range(2)] == [[0, 2], [1, 3]]
    assert [stage_ids_for_rank(r, 2, 4, "ZBVZeroBubble") for r in range(2)] == [[0, 3], [1, 2]]
    assert [stage_ids_for_rank(r, 4, 8, "DualPipeV") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]


BAD = [
    (["parallelism.pp_schedule=Interleaved1F1B", "model.n_layers=3"], "fewer than the 4 pipeline stages"),
    (["parallelism.pp_layers_per_stage=3"], "must be >= 1 and divide model.n_layers=4"),
    (["parallelism.pp_layers_per_stage=1"], "runs one stage per rank"),
    (["parallelism.pp_schedule=ZBVZeroBubble", "parallelism.pp_layers_per_stage=4", "model.n_layers=8",
      "parallelism.pp_microbatches=2"], "needs exactly 2\\*pp=4 stages"),
    (["parallelism.pp_split_points=[layers.7]"], "'layers.7' is not a layer"),
    (["parallelism.pp_split_points=[layers.2]", "parallelism.pp_layers_per_stage=2"], "set only one of"),
    (["parallelism.pp_microbatches=3"], "not divisible by 3 pipeline microbatches"),
    (["parallelism.pp_schedule=DualPipeV", "parallelism.pp_microbatches=2"], "needs parallelism.pp_microbatches >= 4"),
    (["parallelism.pp_schedule=Interleaved1F1B", "parallelism.pp_microbatches=5", "training.local_batch_size=10"],
     "multiple of its rounds"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[m[:24] for _, m in BAD])
def test_check_config_errors(overrides, message):
    cfg = compose_cfg(["parallelism=pp", "cluster.nproc_per_node=2", "model.n_layers=4",
                       f"training.local_batch_size={GLOBAL_BATCH}", *overrides])
    with pytest.raises(ConfigError, match=message) as err:
        validate(cfg)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("preset,nproc", [("pp", 2), ("fsdp_pp", 4), ("3d", 8), ("4d", 16)])
def test_presets_validate(preset, nproc):
    cfg = compose_cfg([f"parallelism={preset}", f"cluster.nproc_per_node={nproc}"])
    validate(cfg)
    d = ParallelDims(world_size=nproc, **{k: v for k, v in cfg.parallelism.items() if k not in ("_target_", "name")})
    assert d.pp == 2 and d.dp_replicate * d.dp_shard * d.tp * d.pp == nproc


def test_runner_lets_the_schedule_drop_each_microbatch_output():
    """The runner never asks torch's schedule to keep the last stage's outputs: with
    ``return_outputs=True`` (torch's default) every microbatch's logits stay alive until the step
    ends (measured on debug pp(2), 8 microbatches: the last stage's peak 89.2 -> 75.2 MiB).
    The losses still come back through the loss function, one per microbatch, and their mean is
    the step's loss."""
    import contextlib
    from types import SimpleNamespace

    import torch

    from titan_hydra.parallel.pp import PipelineRunner

    class RecordingSchedule:
        def __init__(self):
            self.calls = []

        def step(self, *args, target=None, **kwargs):
            self.calls.append(kwargs)
            for mb in target.chunk(4):  # what torch does: the loss of each microbatch
                runner.loss_fn(mb.float(), mb)

    schedule = RecordingSchedule()
    dims_ = SimpleNamespace(broadcast_pp_loss=lambda loss: loss)
    labels = torch.arange(8.0).reshape(4, 2)
    # this rank (pp rank 0) holds both stages, or only the last one
    for first, parts, owner in ((True, {0: torch.nn.Identity(), 1: torch.nn.Identity()}, [0, 0]),
                                (False, {1: torch.nn.Identity()}, [1, 0])):
        runner = PipelineRunner(parts, owner, lambda loss_fn: schedule, n_microbatches=4, grad_accum=1,
                                loss_fn=lambda out, tgt: out.mean(), dims=dims_,
                                step_context=lambda inputs, labels: contextlib.nullcontext(),
                                pp_rank=0, group=None, device=torch.device("cpu"))
        assert runner.has_first_stage is first and runner.has_last_stage and runner.schedule is schedule
        loss = runner.forward_backward(labels, labels)
        assert schedule.calls[-1].get("return_outputs") is False
        assert loss.item() == pytest.approx(3.5)  # mean of the 4 microbatch means 0.5 .. 6.5
