"""Optimizers from config: per-group settings by parameter name and shape (AdamW leaves 1-D
parameters undecayed by default), several optimizer classes behind one interface (Muon for the
blocks' matrices + AdamW for the rest) driven by one LR schedule, Muon equal to torch.optim.Muon
bit for bit, Muon under fsdp(2) / tp(2) equal to one process (fp32), exact resume of both
optimizers' state, and one-line errors for group specs that select nothing or overlap."""

from __future__ import annotations

import shutil
import sys

import pytest
import torch

from titan_hydra.spec import spec_of
from helpers import BASE, GLOBAL_BATCH, assert_parity, compose_cfg, floor_bound, read_metrics, run_layout, run_single
from titan_hydra.errors import ConfigError
from titan_hydra.models.registry import build_model
from titan_hydra.train.muon import Muon
from titan_hydra.train.optimizers import OptimizerList, build_optimizer
from numerics import assert_same_function


def debug_model():
    cfg = compose_cfg(["model=llama3_debug", "model.n_layers=2"])
    _, model = build_model(cfg.model)
    model.init_weights("cpu")
    return model


@pytest.mark.parametrize("adjust", [None, "match_rms_adamw"])
@pytest.mark.parametrize("shape", [(24, 8), (8, 24)])
def test_muon_equals_torch_muon_bit_for_bit(shape, adjust):
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(*shape))
    b = torch.nn.Parameter(a.detach().clone())
    ours = Muon([a], lr=0.02, weight_decay=0.1, adjust_lr_fn=adjust)
    ref = torch.optim.Muon([b], lr=0.02, weight_decay=0.1, adjust_lr_fn=adjust)
    for _ in range(4):
        g = torch.randn(*shape)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    assert torch.equal(a, b)
    assert not torch.equal(a, torch.zeros_like(a))


def test_adamw_default_skips_decay_on_1d_parameters():
    model = debug_model()
    opt = build_optimizer(compose_cfg([]).optimizer, list(model.named_parameters()))
    assert type(opt) is torch.optim.AdamW
    decay = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        assert decay[id(p)] == (0.0 if p.ndim == 1 else 0.1), name
    assert len(decay) == len(list(model.parameters()))
    plain = build_optimizer(compose_cfg(["optimizer.param_groups=[]"]).optimizer, list(model.named_parameters()))
    assert [g["weight_decay"] for g in plain.param_groups] == [0.1]


def test_muon_config_splits_matrices_and_one_schedule_drives_both():
    from titan_hydra.errors import instantiate_checked as instantiate  # drops the option's ``name`` label

    model = debug_model()
    cfg = compose_cfg(["optimizer=muon", "lr_scheduler.warmup_steps=2", "training.steps=10"])
    opt = build_optimizer(cfg.optimizer, list(model.named_parameters()))
    assert isinstance(opt, OptimizerList)
    adamw, muon = opt.optimizers
    assert type(adamw) is torch.optim.AdamW and type(muon) is Muon
    muon_params = {id(p) for g in muon.param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        assert (id(p) in muon_params) == (name.startswith("layers.") and p.ndim == 2), name
    sched = instantiate(cfg.lr_scheduler)(opt, 10)
    peaks = [g["lr"] for g in opt.param_groups]
    for _ in range(5):
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        opt.step()
        sched.step()
    ratios = [g["lr"] / peak for g, peak in zip(opt.param_groups, [g["initial_lr"] for g in opt.param_groups])]
    # one multiplier for every group: lr = initial_lr x f, so lr / initial_lr is f within an fp64 rounding
    # of the product and one of the quotient (2 ulps of f < 1 each)
    assert max(ratios) - min(ratios) <= 4 * sys.float_info.epsilon and ratios[0] < 1.0
    assert {g["initial_lr"] for g in opt.param_groups} == {cfg.optimizer.lr} and peaks  # Muon takes AdamW's LR (match_rms_adamw)
    assert len(opt.state) == len(list(model.parameters()))  # both members' state, one view


@pytest.mark.parametrize("groups, message", [
    ("[{name: a, ndim: 1},{name: b, match: ['*norm*']}]", r"param_groups 'a' and 'b' both select parameter"),
    ("[{name: typo, match: ['layers.*.atention.*']}]", r"param_groups 'typo' selects no parameter"),
    ("[{match: ['*']}]", r"param_groups\[0\] needs a name"),
    ("[{name: m, ndim: 1, _target_: titan_hydra.train.muon.Muon}]", r"param_groups 'm': Muon takes 2-D parameters only"),
    ("[{name: x, _target_: torch.nn.Linear}]", r"is not a torch.optim.Optimizer class"),
])
def test_bad_group_specs_are_one_line_errors(groups, message):
    model = debug_model()
    cfg = compose_cfg([f"optimizer.param_groups={groups}"])
    with pytest.raises(ConfigError, match=message) as err:
        build_optimizer(cfg.optimizer, list(model.named_parameters()))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("option", ["adamw", "muon"])
def test_a_default_group_that_selects_nothing_is_dropped(option):
    """OLMo v1's LayerNorms have no weights: the default ``no_weight_decay`` group (``optional: true``)
    finds no 1-D parameter and is dropped, every parameter is still stepped; a group the user writes
    without ``optional`` that selects nothing is still refused."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([torch.nn.Linear(8, 8, bias=False)] * 1)})
    cfg = compose_cfg([f"optimizer={option}"])
    opt = build_optimizer(cfg.optimizer, list(model.named_parameters()))
    names = [g.get("group_name") for g in opt.param_groups]
    assert "no_weight_decay" not in names
    assert sum(len(g["params"]) for g in opt.param_groups) == 1
    cfg = compose_cfg(["optimizer.param_groups=[{name: decay_free, ndim: 1, weight_decay: 0.0}]"])
    with pytest.raises(ConfigError, match="param_groups 'decay_free' selects no parameter"):
        build_optimizer(cfg.optimizer, list(model.named_parameters()))


# ----------------------------------------------------------------------------- layouts
# fp32 Newton-Schulz: the layouts feed it gradients equal to fp32 rounding, so updates agree to it too
MUON = ["optimizer=muon", "optimizer.lr=8e-4", "optimizer.param_groups.0.ns_dtype=float32", "optimizer.param_groups.0.lr=2e-3",
        "checkpoint=default",
        "checkpoint.interval=5", "checkpoint.keep_latest_k=0"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """(run dir, losses, parity bound) of Muon in one process. Newton-Schulz's five matrix products
    amplify a gradient's rounding far more than AdamW does, and by how much depends on the CPU's
    kernels (2e-4 after 20 steps on an AVX512-BF16 EPYC, where AdamW moved 1.4e-6): the bound is
    measured here, from the same run accumulated as 2 x 4 (``helpers.floor_bound``)."""
    path = tmp_path_factory.mktemp("muon_single")
    losses = run_single(path, MUON)
    accumulated = run_single(tmp_path_factory.mktemp("muon_accumulated"),
                             [*MUON, f"training.local_batch_size={GLOBAL_BATCH // 2}"])
    return path, losses, floor_bound(max(abs(a - b) for a, b in zip(accumulated, losses)), losses)


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
@pytest.mark.slow
@pytest.mark.gate("tp")
def test_muon_layout_loss_parity(tmp_path, single, layout, record_property):
    """Muon orthogonalizes whole matrices although FSDP / TP hold shards: losses equal one process."""
    _, reference, bound = single
    losses = run_layout(tmp_path, [*MUON, f"parallelism={layout}"], nproc=2, dp=2 if layout == "fsdp" else 1)
    assert_parity(losses, reference, bound, f"muon {layout}", record_property)
    if layout == "tp":
        adam = run_single(tmp_path / "adamw", [])
        assert max(abs(a - b) for a, b in zip(reference, adam)) > 1e-3  # Muon really trains differently
        return
    # resharded resume: the fsdp(2) run's step-5 state (sharded Muon momentum, AdamW moments) in one process
    from titan_hydra.train.pretrain import run

    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "run" / "checkpoint", resumed / "checkpoint")
    shutil.rmtree(resumed / "checkpoint" / "step-10")
    cfg = compose_cfg(BASE + MUON + ["cluster.nproc_per_node=1", "parallelism=single",
                                     f"training.local_batch_size={GLOBAL_BATCH}"])
    assert_parity(run(spec_of(cfg), str(resumed))["losses"], reference, bound, "muon fsdp(2) -> single resume",
                  record_property)


def test_muon_resume_is_exact(single, tmp_path, capsys):
    """Both optimizers' state (Muon momentum, AdamW moments) survive the checkpoint: steps 6-10 after
    resuming from step 5 equal the uninterrupted run bit for bit."""
    from titan_hydra.train.pretrain import run

    path, reference, _ = single
    shutil.copytree(path / "run" / "checkpoint", tmp_path / "checkpoint")
    shutil.rmtree(tmp_path / "checkpoint" / "step-10")
    cfg = compose_cfg(BASE + MUON + ["cluster.nproc_per_node=1", "parallelism=single",
                                     f"training.local_batch_size={GLOBAL_BATCH}"])
    capsys.readouterr()
    losses = run(spec_of(cfg), str(tmp_path))["losses"]
    assert f"loaded {tmp_path / 'checkpoint' / 'step-5'}" in capsys.readouterr().out
    assert losses == reference
    rows = read_metrics(path / "run")
    assert rows[-1]["lr/muon_matrices"] == pytest.approx(rows[-1]["lr"] * 2.5)  # a group's own LR is logged


def adamw_node(**extra):
    return {"_target_": "torch.optim.AdamW", "lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1, **extra}


@pytest.mark.parametrize("extra, fused, foreach", [({}, True, None), ({"fused": False}, False, None),
                                                     ({"foreach": True}, None, True)])
def test_adamw_is_fused_unless_the_config_chooses(extra, fused, foreach):
    """torch's CPU default is the per-tensor loop (7x slower on 300M parameters); an unset
    implementation becomes fused, a chosen one is kept."""
    opt = build_optimizer(adamw_node(**extra), list(debug_model().named_parameters()))
    assert opt.defaults["fused"] is fused and opt.defaults["foreach"] is foreach


def test_fused_adamw_steps_as_the_loop():
    """Five steps from the same parameters and gradients; both implementations run in fp64 too, so
    the comparison is derived (tests/numerics.py): the fp64 runs agree to fp64 rounding."""
    torch.manual_seed(0)
    start = [torch.randn(32, 16), torch.randn(16)]
    grads = [[torch.randn_like(p) for p in start] for _ in range(5)]

    def compute(dtype):
        a = [torch.nn.Parameter(p.to(dtype, copy=True)) for p in start]
        b = [torch.nn.Parameter(p.to(dtype, copy=True)) for p in start]
        fused = build_optimizer(adamw_node(), [("w", a[0]), ("n", a[1])])
        loop = build_optimizer(adamw_node(fused=False), [("w", b[0]), ("n", b[1])])
        assert fused.defaults["fused"] and not loop.defaults["fused"]
        for step in grads:
            for p, q, g in zip(a, b, step):
                p.grad, q.grad = g.to(dtype), g.to(dtype)
            fused.step()
            loop.step()
        return dict(zip("wn", (p.detach() for p in a))), dict(zip("wn", (q.detach() for q in b)))

    assert_same_function(compute)
    moved, _ = compute(torch.float32)
    for p, p0 in zip(moved.values(), start):
        assert (p - p0).abs().max() > 1e-3  # they moved, by the same steps
