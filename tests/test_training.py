"""The trainer on the built-in corpus: learning, determinism, precision, accumulation,
divergence handling and LR schedules — all checked by numbers."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import TINY, compose_cfg
from titan_hydra.errors import TrainingDiverged
from titan_hydra.train.lr_schedule import lr_multiplier
from titan_hydra.train.pretrain import run

FAST = TINY + ["logger=minimal", "training.val_freq=0", "cluster.threads_per_proc=1"]


def train(tmp_path, overrides, name="run"):
    cfg = compose_cfg(FAST + overrides)
    return run(cfg, str(tmp_path / name))


def test_thirty_steps_lower_the_loss(tmp_path):
    # The llama3_debug shape itself (dim 256, 6 layers), shorter sequences to stay fast.
    cfg = compose_cfg(["logger=minimal", "training.val_freq=0", "cluster.threads_per_proc=1",
                       "training.steps=30", "training.seq_len=128", "data.max_documents=200"])
    losses = run(cfg, str(tmp_path / "run"))["losses"]
    assert len(losses) == 30
    # At init the logits have unit variance: a little above uniform guessing, ln(2048) = 7.62.
    assert math.log(2048) - 0.2 < losses[0] < math.log(2048) + 1.0, losses[0]
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 1.5, (first, last)


def test_same_seed_same_losses_and_other_seed_differs(tmp_path):
    args = ["training.steps=5", "training.deterministic=true", "training.mixed_precision=fp32"]
    a = train(tmp_path, args, "a")["losses"]
    b = train(tmp_path, args, "b")["losses"]
    c = train(tmp_path, args + ["training.seed=7"], "c")["losses"]
    assert a == b
    assert a != c


def test_bf16_and_fp32_both_train_and_agree_at_start(tmp_path):
    fp32 = train(tmp_path, ["training.steps=6", "training.mixed_precision=fp32"], "fp32")["losses"]
    bf16 = train(tmp_path, ["training.steps=6", "training.mixed_precision=bf16"], "bf16")["losses"]
    assert all(math.isfinite(x) for x in fp32 + bf16)
    # Same weights and data: bf16 autocast only perturbs the loss by rounding.
    assert abs(fp32[0] - bf16[0]) < 0.02, (fp32[0], bf16[0])
    assert max(abs(x - y) for x, y in zip(fp32, bf16)) < 0.1


def test_gradient_accumulation_equals_one_big_batch(tmp_path):
    base = ["training.steps=4", "training.mixed_precision=fp32", "training.global_batch_size=8"]
    big = train(tmp_path, base + ["training.local_batch_size=8"], "big")["losses"]
    acc = train(tmp_path, base + ["training.local_batch_size=2"], "acc")["losses"]
    assert max(abs(x - y) for x, y in zip(big, acc)) < 1e-5, (big, acc)


def test_diverging_loss_stops_with_clear_error(tmp_path):
    with pytest.raises(TrainingDiverged, match=r"loss is (nan|inf) at step \d+"):
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
    from hydra.utils import instantiate

    opt = instantiate(cfg.optimizer)([torch.nn.Parameter(torch.zeros(2))])
    assert type(opt) is torch.optim.Adam
    sched = instantiate(cfg.lr_scheduler)(opt, 10)
    lrs = []
    for _ in range(10):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[4] == pytest.approx(cfg.optimizer.lr)  # stable phase of warmup-stable-decay
    assert lrs[-1] < lrs[4]
