"""The trainer on the built-in corpus: learning, determinism, precision, accumulation,
divergence handling and LR schedules — all checked by numbers.

Model families: learning, the initial loss, and short compile+AC / float8 runs are checked for
every family (Llama 3 and Qwen3); the rest runs the default Llama 3.
"""

from __future__ import annotations

import math

import pytest
import torch

from titan_hydra.spec import spec_of
from helpers import FAMILIES, TINY, UNTIED, assert_parity, compose_cfg, float8_bound, machine_bound
from titan_hydra.errors import TrainingDiverged
from titan_hydra.schedules import lr_multiplier
from titan_hydra.train.pretrain import run

FAST = TINY + ["logger=minimal", "training.val_freq=0", "cluster.threads_per_proc=1"]


def train(tmp_path, overrides, name="run"):
    cfg = compose_cfg(FAST + overrides)
    return run(spec_of(cfg), str(tmp_path / name))


# (family overrides, whether the first loss must sit near uniform guessing, least drop of the
# 3-step mean over 30 steps). Measured (first 3 -> last 3): llama3_debug with 3 of its 6 layers
# 8.10 -> 6.51 (fp32 and bf16 alike; 6 layers: 8.06 -> 6.31 in ~3x the time; 2 layers end at 6.65,
# short of the uniform - 1 bound); qwen3_debug (tied, 1/dim init) with 2 layers 7.62 -> 6.45. The
# drops asked are 1.2 and 1.0, and the run must also end 1 nat below uniform.
LEARNING = [
    pytest.param(["model.n_layers=3"], True, 1.2, id="llama3"),
    pytest.param(["model=qwen3_debug", "model.n_layers=2"], True, 1.0, id="qwen3"),
]


@pytest.mark.parametrize("model, init_near_uniform, min_drop", LEARNING)
@pytest.mark.gate("llama3")
def test_thirty_steps_lower_the_loss(tmp_path, model, init_near_uniform, min_drop):
    # The debug shapes (dim 256) with 2 of their 6 layers,
    # shorter sequences to stay fast.
    cfg = compose_cfg(["logger=minimal", "training.val_freq=0", "cluster.threads_per_proc=1",
                       "training.steps=30", "training.seq_len=128", "data.max_documents=200", *model])
    losses = run(spec_of(cfg), str(tmp_path / "run"))["losses"]
    assert len(losses) == 30 and all(math.isfinite(x) for x in losses), losses
    if init_near_uniform:
        # At init the logits have unit variance: a little above uniform guessing, ln(2048) = 7.62.
        assert math.log(2048) - 0.2 < losses[0] < math.log(2048) + 1.0, losses[0]
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - min_drop, (first, last)
    assert last < math.log(2048) - 1.0, (first, last)


# The loss of a freshly initialized debug model on random tokens: O(1) logits put it a little
# above ln(vocab). Measured (dim 256, 6 layers): llama3 8.0, qwen3 untied 8.1, qwen3 tied 10.8
# with a dim**-0.5 tied init (the self-logit ~sqrt(dim)), ~7.6 with the 1/dim one in use.
@pytest.mark.parametrize("model", [
    pytest.param([], id="llama3"),
    pytest.param(["model=qwen3_debug", UNTIED], id="qwen3_untied"),
    pytest.param(["model=qwen3_debug"], id="qwen3_tied"),
])
def test_initial_loss_is_near_uniform(model):
    import torch.nn.functional as F

    from titan_hydra.models.registry import build_model

    cfg = compose_cfg(["training.seq_len=128", *model])
    torch.manual_seed(0)
    _, m = build_model(cfg.model)
    m.init_weights()
    tokens = torch.randint(0, cfg.model.vocab_size, (4, 129), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = m(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).item()
    assert math.log(2048) - 0.2 < loss < math.log(2048) + 1.0, loss


def test_same_seed_same_losses_and_other_seed_differs(tmp_path):
    args = ["training.steps=5", "training.deterministic=true", "training.mixed_precision=fp32"]
    a = train(tmp_path, args, "a")["losses"]
    b = train(tmp_path, args, "b")["losses"]
    c = train(tmp_path, args + ["training.seed=7"], "c")["losses"]
    assert a == b
    assert a != c
    # deterministic mode is process-wide: the next run in this process (tests, Hydra's in-process
    # multirun) gets its own setting, not this one's (inherited, it made a later compiled
    # selective-AC run abort the test worker)
    assert torch.are_deterministic_algorithms_enabled()
    train(tmp_path, ["training.steps=1", "training.mixed_precision=fp32"], "d")
    assert not torch.are_deterministic_algorithms_enabled()


def test_bf16_and_fp32_both_train_and_agree_at_start(tmp_path):
    fp32 = train(tmp_path, ["training.steps=6", "training.mixed_precision=fp32"], "fp32")["losses"]
    bf16 = train(tmp_path, ["training.steps=6", "training.mixed_precision=bf16"], "bf16")["losses"]
    assert all(math.isfinite(x) for x in fp32 + bf16)
    # Same weights and data: bf16 autocast only perturbs the loss by rounding.
    assert abs(fp32[0] - bf16[0]) < 0.02, (fp32[0], bf16[0])
    assert max(abs(x - y) for x, y in zip(fp32, bf16)) < 0.1


def test_gradient_accumulation_equals_one_big_batch(tmp_path, run_cache, record_property):
    """4 x 2 sums the batch's gradients in another order than 1 x 8, nothing else: the rounding
    floor's kind of comparison (helpers.machine_bound: the parity model's 2 x 4 floor here)."""
    base = ["training.steps=4", "training.mixed_precision=fp32", "training.global_batch_size=8"]
    big = train(tmp_path, base + ["training.local_batch_size=8"], "big")["losses"]
    acc = train(tmp_path, base + ["training.local_batch_size=2"], "acc")["losses"]
    assert_parity(acc, big, atol=machine_bound(run_cache, big), label="accumulated 4 x 2", record=record_property)


def test_diverging_loss_stops_with_clear_error(tmp_path):
    # health=default skips the non-finite steps first, then stops (no checkpoint to roll back to)
    with pytest.raises(TrainingDiverged, match=r"(loss|grad_norm) is (nan|inf) at step \d+"):
        train(
            tmp_path,
            ["training.steps=30", "optimizer.lr=1e4", "training.max_norm=0",
             "training.mixed_precision=fp32", "lr_scheduler=constant"],
        )


def test_validation_loss_is_reported_and_deterministic(tmp_path):
    args = ["training.steps=4", "training.val_freq=2", "training.val_steps=2", "training.mixed_precision=fp32"]
    a = train(tmp_path, args, "a")
    b = train(tmp_path, args, "b")
    assert a["final_val_loss"] is not None and math.isfinite(a["final_val_loss"])
    assert a["final_val_loss"] == b["final_val_loss"]


@pytest.mark.parametrize(
    "kind,expected",
    [
        # (step -> multiplier) for 20 steps, 4 warmup steps
        ("warmup", {0: 1 / 5, 3: 4 / 5}),
        ("cosine", {4: 1.0 - (1 - 0.5 * (1 + math.cos(math.pi / 16))), 19: 0.0}),
        ("linear", {4: 15 / 16, 11: 8 / 16, 19: 0.0}),
        ("wsd_sqrt", {4: 1.0, 15: 1.0, 16: 1 - math.sqrt(1 / 4), 19: 0.0}),
        ("constant", {0: 1.0, 19: 1.0}),
    ],
)
def test_lr_schedule_shapes(kind, expected):
    kw = dict(total_steps=20, warmup_steps=4, decay_ratio=None, decay_type="cosine", min_lr_factor=0.0)
    if kind == "linear":
        kw["decay_type"] = "linear"
    if kind == "wsd_sqrt":
        kw.update(decay_ratio=0.25, decay_type="sqrt")
    if kind == "constant":
        kw.update(warmup_steps=0, decay_type="none")
    for step, value in expected.items():
        assert lr_multiplier(step, **kw) == pytest.approx(value, abs=1e-9), (kind, step)


def test_min_lr_factor_floors_the_decay():
    kw = dict(total_steps=10, warmup_steps=0, decay_ratio=None, decay_type="cosine", min_lr_factor=0.1)
    assert lr_multiplier(9, **kw) == pytest.approx(0.1)
    assert lr_multiplier(0, **kw) > 0.9


def test_optimizer_and_schedule_come_from_config(tmp_path):
    cfg = compose_cfg(FAST + ["optimizer=adam", "lr_scheduler=wsd", "training.steps=10"])
    from titan_hydra.errors import instantiate_checked as instantiate  # drops the option's ``name`` label

    from titan_hydra.train.optimizers import build_optimizer

    opt = build_optimizer(cfg.optimizer, [("w", torch.nn.Parameter(torch.zeros(2)))])
    assert type(opt) is torch.optim.Adam
    sched = instantiate(cfg.lr_scheduler)(opt, 10)
    lrs = []
    for _ in range(10):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[4] == pytest.approx(cfg.optimizer.lr)  # stable phase of warmup-stable-decay
    assert lrs[-1] < lrs[4]


# ------------------------------------------------------------------------------- per family, e2e
# compile (regional, inductor) + selective-op activation checkpointing, and emulated float8, each
# through the trainer for 4 fp32 steps on the tiny model of every family (helpers.FAMILIES on top
# of TINY: Qwen3 with tied embeddings, head_dim 32 on a 64-wide model, QK-norm), compared with the
# same family's eager fp32 run.
SHORT = ["training.steps=4", "training.mixed_precision=fp32"]
# Compiled + AC vs eager: measured max |diff| 0 (llama3) and 9.5e-7 (qwen3).
# Float8 (tensorwise, emulated: float8 casts and scales, high-precision matmul) on every block
# linear (output excluded) vs fp32: within helpers.float8_bound of the same run's bf16 autocast
# distance from fp32 (measured 2.9e-5 (llama3) and 6.9e-4 (qwen3) against bf16's 4.4e-4 / 4.0e-5).
FLOAT8 = ["float8=tensorwise", "float8.emulate=true", "float8.auto_filter_small_kn=false"]
LINEARS_PER_BLOCK = 7  # wq wk wv wo w1 w2 w3


def eager_losses(run_cache, family: str) -> list[float]:
    """The family's eager fp32 SHORT run (once per family per session)."""
    return run_cache.once(("eager", family), lambda path: train(path, FAMILIES[family] + SHORT)["losses"])


def bf16_losses(run_cache, family: str) -> list[float]:
    """The same run under bf16 autocast (once per family per session)."""
    return run_cache.once(("eager_bf16", family), lambda path: train(
        path, FAMILIES[family] + SHORT + ["training.mixed_precision=bf16"])["losses"])


# compile + selective-op AC through the trainer: test_perf_layouts.test_compile_composes_with_layouts
# (fsdp2, tp2, pp2 against eager); per block for Llama 3 and Qwen3: test_perf_features.

@pytest.mark.parametrize("family", list(FAMILIES))
def test_float8_emulated_tracks_fp32(tmp_path, run_cache, record_property, float8_conversions, family):
    converted = float8_conversions
    losses = train(tmp_path, FAMILIES[family] + SHORT + FLOAT8)["losses"]
    assert len(converted) == 2 * LINEARS_PER_BLOCK and not any("output" in n for n in converted), converted
    ref = eager_losses(run_cache, family)
    assert len(losses) == len(ref) == 4 and all(math.isfinite(x) for x in losses), (losses, ref)
    diff = max(abs(a - b) for a, b in zip(losses, ref))
    bound = float8_bound(bf16_losses(run_cache, family), ref)
    record_property("float8 max |loss - fp32|", diff)
    record_property("float8 bound", bound)
    assert 0 < diff <= bound, (
        f"max |loss - fp32| = {diff:.3g}, not in (0, {bound:.3g}]\nfloat8: {losses}\nfp32: {ref}")
