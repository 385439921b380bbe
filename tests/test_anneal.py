"""Anneal branches (``lr_scheduler=cooldown``): the branch's learning rates against their closed
form, a branch off a constant run against the uninterrupted run of the equivalent wsd schedule
(bit for bit), and the one-line refusals of a branch with nothing to branch from.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from helpers import by_step, compose_cfg
from titan_hydra.checkpoint.resume import branch_point
from titan_hydra.checkpoint.storage import CheckpointError
from titan_hydra.errors import ConfigError, UserError
from titan_hydra.schedules import CooldownSchedule, WarmupDecay

PEAKS = (1e-3, 3e-4)  # two param groups with their own peak (muP-style): each decays from its own LR


def _optimizer() -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))]
    return torch.optim.SGD([{"params": [p], "lr": lr} for p, lr in zip(params, PEAKS)])


def _lrs(sched, steps: range) -> list[list[float]]:
    """The LRs of optimizer steps ``steps`` (0-based), stepping the schedule as the trainer does."""
    out = []
    for step in steps:
        assert sched.last_epoch == step
        out.append(list(sched.get_last_lr()))
        sched.optimizer.step()
        sched.step()
    return out


def _closed_form(step: int, branch: int, total: int, start: float, floor: float, shape: str) -> float:
    """The cooldown multiplier in fp64, written from its definition: from ``start`` at the branch to
    ``floor`` at ``total``, the progress of step k being (k - branch + 1) / (total - branch)."""
    p = (step - branch + 1) / (total - branch)
    ahead = {"sqrt": 1 - math.sqrt(p), "linear": 1 - p, "cosine": 0.5 * (1 + math.cos(math.pi * p))}[shape]
    return floor + (start - floor) * ahead


@pytest.mark.parametrize("shape", ["sqrt", "linear", "cosine"])
def test_cooldown_learning_rates_follow_the_closed_form(shape):
    """A branch at step 10 of a 20-step warmup-cosine run (so the base's LR there is not its peak)
    to step 16: every LR from 10 on is the closed form's, per group, ending on the floor; the
    branch's own state, saved mid-cooldown, resumes the same sequence."""
    base = WarmupDecay(warmup_steps=2, min_lr_factor=0.1)(_optimizer(), 20)
    _lrs(base, range(10))
    start = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (10 - 2 + 1) / 18))  # the base's multiplier at step 10
    branch = CooldownSchedule(decay_type=shape, min_lr_factor=0.05)(_optimizer(), 16)
    branch.load_state_dict(base.state_dict())
    got = _lrs(branch, range(10, 13))
    saved = json.loads(json.dumps(branch.state_dict()))  # what a checkpoint holds (JSON)
    resumed = CooldownSchedule(decay_type=shape, min_lr_factor=0.05)(_optimizer(), 16)
    resumed.load_state_dict(saved)
    got += _lrs(resumed, range(13, 16))
    for step, lrs in zip(range(10, 16), got):
        want = [peak * _closed_form(step, 10, 16, start, 0.05, shape) for peak in PEAKS]
        # the same fp64 arithmetic in another order: a few ulps
        assert lrs == pytest.approx(want, rel=1e-13, abs=0), (step, lrs, want)
    assert got[-1] == pytest.approx([0.05 * p for p in PEAKS], rel=1e-15)


def test_a_scaled_cooldown_starts_from_the_base_schedule_not_the_step_factor():
    """Base and branch both under a factor of the step (2 from step 5 on, a batch ramp's LR
    scaling, folded into the multipliers): the branch at step 10 of a constant run starts from the
    base's multiplier 1, so its LR is peak x factor x the cooldown, continuous with the base; its
    own state resumes."""
    factor = lambda step: 2.0 if step >= 5 else 1.0  # noqa: E731
    base = WarmupDecay(warmup_steps=0, decay_type="none")(_optimizer(), 20, factor)
    _lrs(base, range(10))
    branch = CooldownSchedule(min_lr_factor=0.1)(_optimizer(), 14, factor)
    branch.load_state_dict(json.loads(json.dumps(base.state_dict())))
    got = _lrs(branch, range(10, 12))
    resumed = CooldownSchedule(min_lr_factor=0.1)(_optimizer(), 14, factor)
    resumed.load_state_dict(json.loads(json.dumps(branch.state_dict())))
    got += _lrs(resumed, range(12, 14))
    for step, lrs in zip(range(10, 14), got):
        want = [peak * 2.0 * _closed_form(step, 10, 14, 1.0, 0.1, "sqrt") for peak in PEAKS]
        assert lrs == pytest.approx(want, rel=1e-13, abs=0), (step, lrs, want)


def test_cooldown_without_a_checkpoint_refuses_its_first_step():
    """The backstop behind validate's refusal: a cooldown that never loaded a base cannot step."""
    sched = CooldownSchedule()(_optimizer(), 8)
    sched.optimizer.step()
    with pytest.raises(UserError, match="branches off a checkpoint"):
        sched.step()


def _fake_checkpoint(folder: Path, step: int, kind: str = "full") -> None:
    (folder / f"step-{step}").mkdir(parents=True)
    (folder / f"step-{step}" / "COMPLETE.json").write_text(json.dumps({"step": step, "kind": kind}))


def test_branch_point_refusals(tmp_path):
    folder = tmp_path / "base" / "checkpoint"
    _fake_checkpoint(folder, 40)
    _fake_checkpoint(folder, 80)
    _fake_checkpoint(folder, 90, kind="model_only")
    assert branch_point(folder / "step-40") == 40
    with pytest.raises(CheckpointError, match=r"step-60: no complete checkpoint to branch from; the base saved "
                                              r"steps \[40, 80, 90\]: branch at one of those"):
        branch_point(folder / "step-60")
    with pytest.raises(CheckpointError, match="model-only export"):
        branch_point(folder / "step-90")
    with pytest.raises(CheckpointError, match="holds none: run the base with checkpoint.enable=true"):
        branch_point(tmp_path / "nobase" / "checkpoint" / "step-40")


@pytest.mark.parametrize("extra,message", [
    ([], r"set checkpoint.initial_load_path=<base run>/checkpoint/step-S"),
    (["checkpoint.initial_load_model_only=true"], "set checkpoint.initial_load_model_only=false"),
    (["training.steps=40"], r"branch point \(step 40 .*\) is not before training.steps=40"),
])
def test_cooldown_configs_refused_in_one_line(tmp_path, extra, message):
    from titan_hydra.validate import validate

    _fake_checkpoint(tmp_path / "checkpoint", 40)
    load = [] if not extra else [f"checkpoint.initial_load_path={tmp_path}/checkpoint/step-40",
                                 "checkpoint.initial_load_model_only=false"]
    with pytest.raises(ConfigError, match=message):
        validate(compose_cfg(["lr_scheduler=cooldown", *load, *extra]))


TINY = [
    "model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.vocab_size=2048",
    "training.seq_len=32", "training.local_batch_size=2", "training.mixed_precision=fp32",
    "training.deterministic=true", "training.val_freq=2", "training.val_steps=2", "data.max_documents=40",
    "logger=minimal", "cluster.threads_per_proc=1",
]


def _train(run_dir: Path, *extra: str) -> dict:
    from titan_hydra.train.pretrain import run
    from titan_hydra.validate import validate

    return run(validate(compose_cfg(TINY + list(extra))), str(run_dir), return_state=True)


@pytest.mark.slow
def test_branch_off_a_constant_run_is_the_uninterrupted_wsd_run(tmp_path):
    """Base: constant LR for 6 steps, checkpoints every 2. Branch at step 4, cooling down (1-sqrt,
    to 0) until step 8. The same schedule uninterrupted is wsd with no warmup, decay_ratio 0.5: its
    steps 1-4 are the base's and 5-8 the branch's, bit for bit (losses, gradient norms, LRs,
    validation, final weights), so the branch resumed the base's model, optimizer and data
    position at step 4 and retrained none of the base's steps."""
    base, branch, whole = tmp_path / "base", tmp_path / "branch", tmp_path / "whole"
    _train(base, "training.steps=6", "lr_scheduler=constant", "checkpoint=default", "checkpoint.interval=2",
           "checkpoint.keep_latest_k=0")
    got = _train(branch, "training.steps=8", "lr_scheduler=cooldown", "lr_scheduler.min_lr_factor=0.0",
                 f"checkpoint.initial_load_path={base}/checkpoint/step-4", "checkpoint.initial_load_model_only=false")
    want = _train(whole, "training.steps=8", "lr_scheduler=wsd", "lr_scheduler.warmup_steps=0",
                  "lr_scheduler.decay_ratio=0.5", "lr_scheduler.min_lr_factor=0.0")
    for key in ("loss", "grad_norm", "lr", "val/loss"):
        ref = by_step(whole, key)
        assert {s: v for s, v in by_step(base, key).items() if s <= 4} == {s: v for s, v in ref.items() if s <= 4}, key
        assert by_step(branch, key) == {s: v for s, v in ref.items() if s > 4}, key
    assert by_step(branch, "lr") == {s: 8e-4 * _closed_form(s - 1, 4, 8, 1.0, 0.0, "sqrt") for s in range(5, 9)}
    assert got["full_state"].keys() == want["full_state"].keys()
    for k, v in want["full_state"].items():
        assert torch.equal(got["full_state"][k], v), k


@pytest.mark.slow
def test_sweep_report_draws_each_branch_from_its_branch_point(tmp_path):
    """A sweep of two cooldown jobs off a base run (relative paths, as the experiment writes them):
    each branch's curve starts at the base's step it left from, and the figure is written."""
    from omegaconf import OmegaConf

    from titan_hydra.analysis.anneal import anneal_curves, branch_base, plot_anneal
    from titan_hydra.analysis.runs import tokens_of

    def metrics(run: Path, steps: range, loss) -> None:
        run.mkdir(parents=True, exist_ok=True)
        rows = [{"step": s, "loss": 7.0} for s in steps] + [{"step": s, "val/loss": loss(s)} for s in steps if s % 2 == 0]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sorted(rows, key=lambda r: r["step"])))

    metrics(tmp_path / "outputs" / "base", range(1, 9), lambda s: 8.0 - 0.1 * s)
    for job, (branch, steps) in enumerate([(4, 6), (8, 10)]):
        run = tmp_path / "multirun" / str(job)
        metrics(run, range(branch + 1, steps + 1), lambda s: 7.0 - 0.2 * s)
        (run / ".hydra").mkdir()
        cfg = compose_cfg(TINY + [f"training.steps={steps}", "lr_scheduler=cooldown", "checkpoint.initial_load_model_only=false",
                                  f"checkpoint.initial_load_path=outputs/base/checkpoint/step-{branch}"])
        OmegaConf.save(cfg, run / ".hydra" / "config.yaml")
        OmegaConf.save({"hydra": {"runtime": {"cwd": str(tmp_path)}}}, run / ".hydra" / "hydra.yaml")
    assert branch_base(tmp_path / "multirun" / "0") == tmp_path / "outputs" / "base"
    assert anneal_curves(tmp_path / "multirun") == {
        6: [(4, None), (6, pytest.approx(7.0 - 1.2))], 10: [(8, None), (10, pytest.approx(7.0 - 2.0))]}
    assert tokens_of(tmp_path / "multirun" / "0").through(6) == 6 * 2 * 32  # no schedule: the config's batch
    plot_anneal(tmp_path / "multirun", tmp_path / "anneal.png")
    assert (tmp_path / "anneal.png").stat().st_size > 0


def test_tokens_are_read_from_the_logged_batch_under_a_schedule(tmp_path):
    """Under a batch schedule each training row logs its step's batch_size: the tokens of a run are
    their sum (seq_len 32 from the config), a step without a row counts as the next logged one,
    and a branch continues its base's count."""
    from omegaconf import OmegaConf

    from titan_hydra.analysis.runs import tokens_of

    (tmp_path / ".hydra").mkdir()
    OmegaConf.save(compose_cfg(TINY), tmp_path / ".hydra" / "config.yaml")
    rows = [{"step": 1, "loss": 7.0, "batch_size": 2.0}, {"step": 2, "loss": 7.0, "batch_size": 2.0},
            {"step": 4, "loss": 7.0, "batch_size": 4.0}, {"step": 4, "val/loss": 7.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokens = tokens_of(tmp_path)
    assert [tokens.through(s) for s in range(6)] == [0, 64, 128, 256, 384, 384 + 2 * 32]
    branch = tokens.continued_by(type(tokens)({3: 8 * 32}, 2 * 32), at=2)
    assert branch.through(3) == 128 + 256 and branch.through(4) == 128 + 256 + 64
