"""Weight averaging: the EMA of the weights (``training.ema_decay``, train/ema.py) and the average of
a run's last checkpoints (recipes/average_checkpoints.py).

The EMA is checked against its closed form in fp64, under fsdp(2) against one process (within the
rounding bound the loss-parity tests derive), and across a resume (bit for bit). The checkpoint
average is checked against the mean of its checkpoints' tensors, loaded into another layout than
the one that saved them.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from helpers import BASE, FSDP2, GLOBAL_BATCH, REPO, STEPS, by_step, compose_cfg, floor_bound, launch_here, \
    param_floor_bound
from titan_hydra.checkpoint import CheckpointError, CheckpointManager
from titan_hydra.checkpoint.storage import load_plain, read_marker, read_metadata, save_plain, tensor_entries
from titan_hydra.errors import ConfigError
from titan_hydra.spec import spec_of
from titan_hydra.train.ema import WeightEMA, weight_ema_of
from titan_hydra.train.nulls import NoEMA
from titan_hydra.validate import validate

from titan_hydra.checkpoint.average import average_checkpoints
from titan_hydra.checkpoint.convert import read_model
from titan_hydra.checkpoint.offline import load_model

sys.path.insert(0, str(REPO / "recipes"))
import average_checkpoints as average_recipe  # noqa: E402  (the command lines)
import convert as convert_recipe  # noqa: E402

DECAY = 0.8  # short runs: the EMA must sit visibly apart from both the first and the last weights
U32 = 2.0**-24  # fp32's unit roundoff
EMA = [f"training.ema_decay={DECAY}", "training.val_freq=5", "training.val_steps=2", "training.deterministic=true",
       "checkpoint=default", "checkpoint.interval=2", "checkpoint.keep_latest_k=0"]


# ---------------------------------------------------------------------------- the EMA itself


def test_ema_equals_closed_form():
    """After k steps: ema_k = d^k w_0 + (1 - d) sum_{i=1..k} d^(k-i) w_i, from recorded weights in fp64.

    Bound: each fp32 lerp rounds its subtraction, product and sum (and the weight 1 - d), at most
    4 unit roundoffs of the larger operand; the error of earlier steps is damped by d <= 1, so after
    k steps |ema - closed| <= 4 k u max|w|. Starting from w_1, or swapping d and 1 - d, moves it by
    d^k |w_1 - w_0| or more, orders of magnitude above."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    ema, k = WeightEMA([model], DECAY), 25
    ema.start(0)
    weights = [[p.detach().double().clone() for p in model.parameters()]]
    for _ in range(k):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        ema.update()
        weights.append([p.detach().double().clone() for p in model.parameters()])
    biggest = max(w.abs().max().item() for ws in weights for w in ws)
    for j, shadow in enumerate(ema.shadow):
        closed = DECAY**k * weights[0][j] + (1 - DECAY) * sum(DECAY ** (k - i) * weights[i][j] for i in range(1, k + 1))
        diff = (shadow.double() - closed).abs().max().item()
        assert diff <= 4 * k * U32 * biggest, f"parameter {j}: |ema - closed form| = {diff:.3g}"
        assert (shadow.double() - weights[-1][j]).abs().max().item() > 100 * 4 * k * U32 * biggest  # not the weights


def test_swap_restores_the_weights_bit_for_bit():
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 4)
    ema = WeightEMA([model], 0.5)
    ema.start(0)
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    ema.update()
    trained = [p.detach().clone() for p in model.parameters()]
    seen = ema.validate(lambda: {"val/loss": float(sum(torch.equal(p, s) for p, s in zip(model.parameters(),
                                                                                        ema.shadow))),
                                 "val/web/loss": 0.0})
    assert seen == {"val/ema/loss": 2.0, "val/ema/web/loss": 0.0}  # both tensors were the EMA's inside
    assert all(torch.equal(p, t) for p, t in zip(model.parameters(), trained))
    assert not any(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert isinstance(weight_ema_of([model], 0.0, 0), NoEMA)  # decay 0: no copy, no work


def test_bad_decay_is_refused():
    for value in ("1.0", "-0.1"):
        with pytest.raises(ConfigError, match=rf"training.ema_decay={value} must be within \[0, 1\)"):
            validate(compose_cfg(["dry_run=true", f"training.ema_decay={value}"]), environment=False)


# ---------------------------------------------------------------------------- checkpoint averages: refusals


def _tiny_checkpoint(path: Path, step: int, dim: int = 32, seed: int = 0) -> None:
    from titan_hydra.models.llama3 import FAMILY, Llama3
    from titan_hydra.parallel.parallelism import ParallelDims
    from titan_hydra.schedules import WarmupDecay
    from titan_hydra.train.trainer import TrainState

    torch.manual_seed(seed)
    model = Llama3(dim=dim, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    m = CheckpointManager(run_dir=path, model_parts=[model], optimizer=opt, lr_scheduler=WarmupDecay()(opt, 10),
                          train_loader=object(), train_state=TrainState(), dims=ParallelDims(), family=FAMILY,
                          model_args=model.args, flavor="custom")
    save_plain(path / "checkpoint" / f"step-{step}", m.state_to_save(model_only=True),
               m.run.marker_info(step, "model_only", "float32"))


def test_average_refuses_bad_inputs(tmp_path, capsys):
    for step in (1, 2):
        _tiny_checkpoint(tmp_path, step, seed=step)
    (tmp_path / "checkpoint" / "step-3").mkdir()  # an interrupted save: no marker, not counted
    assert average_recipe.main([str(tmp_path), "--last", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "needs 3 complete ones" in err and "found 2 (steps: 1, 2)" in err, err
    _tiny_checkpoint(tmp_path, 4, dim=16)
    with pytest.raises(CheckpointError, match=r"step-2 is of another model than .*step-4 \(dim=32 \(run has 16\)"):
        average_checkpoints(tmp_path, 2)
    with pytest.raises(CheckpointError, match=r"holds no EMA of the weights .* --weights model"):
        read_model(tmp_path / "checkpoint" / "step-1", "ema")


# ---------------------------------------------------------------------------- launched runs


def _single(run_dir: Path, *extra: str) -> None:
    from titan_hydra.train.pretrain import run

    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = compose_cfg(BASE + EMA + ["cluster.nproc_per_node=1", "parallelism=single",
                                    f"training.local_batch_size={GLOBAL_BATCH}", *extra])
    run(spec_of(cfg), str(run_dir))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The EMA runs the slow tests compare: one process, the same accumulated as 2 x 4 (the
    rounding floor), and fsdp(2) through the launcher; each checkpointing every 2 steps."""
    root = tmp_path_factory.mktemp("ema_runs")
    dirs = {name: root / name for name in ("single", "accumulated", "fsdp2")}
    _single(dirs["single"])
    _single(dirs["accumulated"], f"training.local_batch_size={GLOBAL_BATCH // 2}")
    launch_here(BASE + FSDP2 + EMA, dirs["fsdp2"])
    return dirs


def _ema_tensors(run_dir: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    path = run_dir / "checkpoint" / f"step-{step}"
    return {k[len("ema."):]: v for k, v in load_plain(path, [k for k in tensor_entries(read_metadata(path))
                                                              if k.startswith("ema.")]).items()}


@pytest.mark.slow
def test_ema_under_fsdp_equals_one_process(runs, record_property):
    """fsdp(2) keeps the EMA as local shards of each parameter: its val/ema/loss and EMA tensors
    match one process's within the rounding bound of the same run accumulated as 2 x 4."""
    for key in ("loss", "val/loss"):  # the training weights too: the EMA's swap must leave them as they were
        ref, acc, sharded = (by_step(runs[k], key) for k in ("single", "accumulated", "fsdp2"))
        bound = floor_bound(max(abs(acc[s] - ref[s]) for s in ref), ref.values())
        assert max(abs(sharded[s] - ref[s]) for s in ref) <= bound, (key, sharded, ref)
    single, accumulated, fsdp = (by_step(runs[k], "val/ema/loss") for k in ("single", "accumulated", "fsdp2"))
    assert sorted(single) == sorted(fsdp) == [5, 10], single
    assert all(single[s] != by_step(runs["single"], "val/loss")[s] for s in single)  # the EMA is not the weights
    floor = max(abs(accumulated[s] - single[s]) for s in single)
    bound = floor_bound(floor, single.values())
    diff = max(abs(fsdp[s] - single[s]) for s in single)
    record_property("val/ema/loss max |fsdp2 - single|", diff)
    assert diff <= bound, f"val/ema/loss fsdp2 {fsdp} vs single {single}: {diff:.3g} > {bound:.3g}"
    ema = {name: _ema_tensors(runs[name]) for name in runs}
    assert ema["single"].keys() == ema["fsdp2"].keys() and "layers.0.attention.wq.weight" in ema["single"]
    tensor_bound = param_floor_bound(ema["single"], ema["accumulated"])
    worst = max((ema["fsdp2"][k] - v).abs().max().item() for k, v in ema["single"].items())
    assert worst <= tensor_bound, f"EMA tensors fsdp2 vs single: {worst:.3g} > {tensor_bound:.3g}"


@pytest.mark.slow
def test_resumed_ema_equals_uninterrupted(runs, tmp_path):
    """Resuming step 4 of the one-process run gives its step-10 checkpoint bit for bit, EMA included."""
    from helpers import assert_same_checkpoint

    resumed = tmp_path / "resumed"
    shutil.copytree(runs["single"] / "checkpoint" / "step-4", resumed / "checkpoint" / "step-4")
    _single(resumed)
    assert min(by_step(resumed, "loss")) == 5  # it did resume
    assert_same_checkpoint(resumed, runs["single"], STEPS)  # every entry, ema.* among them
    assert by_step(resumed, "val/ema/loss")[STEPS] == by_step(runs["single"], "val/ema/loss")[STEPS]


@pytest.mark.slow
def test_average_of_last_3_is_their_mean_in_another_layout(runs, tmp_path):
    """The fsdp(2) run's last 3 checkpoints averaged: each tensor is their fp64 mean rounded once to
    fp32 (|avg - mean| <= u |mean|, plus the fp64 running mean's few units of 2^-53), and it loads
    through initial_load_path into one process (not the layout that saved them) bit for bit."""
    out = average_checkpoints(runs["fsdp2"], 3, tmp_path / "avg")
    marker = read_marker(out)
    assert marker["kind"] == "model_only" and [a["step"] for a in marker["averaged"]] == [6, 8, 10]
    keys = sorted(k for k in tensor_entries(read_metadata(out)))
    assert any(k.startswith("ema.") for k in keys) and any(k.startswith("model.") for k in keys)
    avg = load_plain(out, keys)
    sources = [load_plain(runs["fsdp2"] / "checkpoint" / f"step-{s}", keys) for s in (6, 8, 10)]
    for k in keys:
        mean = sum(src[k].double() for src in sources) / 3
        slack = U32 * mean.abs() + 8 * 2.0**-53 * max(src[k].abs().max().item() for src in sources)
        assert bool(((avg[k].double() - mean).abs() <= slack).all()), k
    loaded = _load_into_one_process(out)
    assert all(torch.equal(loaded[k[len("model."):]], avg[k]) for k in keys if k.startswith("model."))
    assert load_model(out)[2] is not None


def _load_into_one_process(path: Path) -> dict[str, torch.Tensor]:
    """``initial_load_path``'s loader (CheckpointManager.load_initial) into a model in this process."""
    from titan_hydra.models.registry import get_family
    from titan_hydra.parallel.parallelism import ParallelDims
    from titan_hydra.schedules import WarmupDecay
    from titan_hydra.train.trainer import TrainState

    info = read_marker(path)["model"]
    family = get_family(info["family"])
    args = family.make_args(info["args"])
    model = family.build(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    m = CheckpointManager(run_dir=path.parent, model_parts=[model], optimizer=opt, lr_scheduler=WarmupDecay()(
        opt, 10), train_loader=object(), train_state=TrainState(), dims=ParallelDims(), family=family,
        model_args=args, flavor="custom")
    m.load_initial(path)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_ema_exports(runs, tmp_path):
    """convert.py --weights ema reads the EMA in place of each parameter (and to-hf writes it)."""
    path = runs["fsdp2"] / "checkpoint" / f"step-{STEPS}"
    _, _, sd = read_model(path, "ema")
    ema = _ema_tensors(runs["fsdp2"])
    assert sd.keys() == ema.keys() and all(torch.equal(sd[k], ema[k]) for k in ema)
    assert convert_recipe.main(["to-hf", str(path), str(tmp_path / "hf"), "--weights", "ema"]) == 0
