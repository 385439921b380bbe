"""The ``parametrization`` group: sp changes nothing, mup is muP (a coordinate check, and the ``mup``
package's own multipliers on the same model), and it composes with layouts, resume and HF export."""

from __future__ import annotations

import functools
import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_parity, compose_cfg, parity_bound, reference_losses, run_layout
from titan_hydra.checkpoint.state import FORMAT_VERSION
from titan_hydra.checkpoint.storage import save_plain
from titan_hydra.errors import ConfigError, UserError
from titan_hydra.errors import instantiate_checked as instantiate
from titan_hydra.models.parametrization import Parametrization, rescale_init
from titan_hydra.models.registry import build_model
from titan_hydra.spec import spec_of
from titan_hydra.train.muon import Muon
from titan_hydra.train.optimizers import OptimizerList, build_optimizer
from titan_hydra.train.pretrain import run
from titan_hydra.train.width_scaling import muon_lr_mult

from titan_hydra.checkpoint import convert  # noqa: E402  (to_hf)

BASE_WIDTH = 64
# the coordinate check's model: 2 blocks, 4 heads (head_dim = width / 4, so the 1/head_dim
# attention scale is exercised), a 256-token vocabulary, 4 AdamW / Muon steps at a large LR
COORD = ["model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=null", "model.vocab_size=256",
         "model.multiple_of=16", "optimizer.weight_decay=0.0", f"parametrization.base_width={BASE_WIDTH}"]
COORD_LR = {"adamw": 1e-2, "muon": 3e-2}
# Bounds on the slope of log RMS(change of a layer's output after 4 steps) vs log width. Measured at
# widths 64..512: mup -0.22 to -0.14 (AdamW) and -0.10 to 0.24 (Muon, settling: block 1 moves 0.278 ->
# 0.302 from 512 to 1024), sp 0.59 to 1.43 (AdamW) and 0.50 to 0.71 (Muon; 0.50 to 0.84 to 1024).
MUP_SLOPE, SP_SLOPE = 0.3, 0.45


def tiny(overrides: list[str]):
    """(spec, model, geometry) of a composed config: the family's init, then the parametrization's."""
    cfg = compose_cfg(overrides)
    spec = spec_of(cfg)
    geometry = instantiate(cfg.parametrization, _convert_="all").geometry(spec.family, spec.model_args)
    model = spec.family.build(spec.model_args)
    torch.manual_seed(0)
    model.init_weights()
    rescale_init(list(model.named_parameters()), geometry)
    return cfg, model, geometry


@functools.lru_cache(maxsize=None)  # the check to 1024 reuses the widths the fast check measured
def layer_changes(width: int, parametrization: str, optimizer: str, steps: int = 4) -> dict[str, float]:
    """RMS of how much each block's output and the logits moved after ``steps`` steps on one batch
    (seeded: the same numbers every call)."""
    cfg, model, geometry = tiny([f"model.dim={width}", f"optimizer={optimizer}", f"optimizer.lr={COORD_LR[optimizer]}",
                                 f"parametrization={parametrization}", *COORD])
    opt = build_optimizer(cfg.optimizer, list(model.named_parameters()), geometry)
    tokens = torch.randint(0, 256, (8, 33), generator=torch.Generator().manual_seed(1))
    outputs: dict[str, torch.Tensor] = {}
    for name, block in model.layers.items():
        block.register_forward_hook(lambda m, i, o, name=name: outputs.__setitem__(f"block{name}", o.detach()))

    def forward() -> dict[str, torch.Tensor]:
        with torch.no_grad():
            logits = model(tokens[:, :-1])
        return {**outputs, "logits": logits}

    before = forward()
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
    after = forward()
    return {k: (after[k] - before[k]).pow(2).mean().sqrt().item() for k in after}


def slope(widths: list[int], values: list[float]) -> float:
    """Least-squares slope of log(values) against log(widths)."""
    x, y = [math.log(w) for w in widths], [math.log(v) for v in values]
    mx, my = sum(x) / len(x), sum(y) / len(y)
    return sum((a - mx) * (b - my) for a, b in zip(x, y)) / sum((a - mx) ** 2 for a in x)


def coordinate_slopes(widths: list[int], parametrization: str, optimizer: str) -> dict[str, float]:
    rows = [layer_changes(w, parametrization, optimizer) for w in widths]
    return {k: slope(widths, [r[k] for r in rows]) for k in rows[0]}


def check_coordinates(widths: list[int], optimizer: str) -> None:
    torch.set_num_threads(1)
    mup = coordinate_slopes(widths, "mup", optimizer)
    sp = coordinate_slopes(widths, "sp", optimizer)
    assert all(abs(s) < MUP_SLOPE for s in mup.values()), f"{optimizer} mup slopes {mup} (sp {sp})"
    assert all(s > SP_SLOPE for s in sp.values()), f"{optimizer} sp slopes {sp} (mup {mup})"


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.gate("adamw")
def test_coordinate_check(optimizer):
    """muP's defining property: after a few large-LR steps every layer's output has moved by the
    same amount at every width under mup, and by more the wider the model under sp."""
    check_coordinates([64, 128, 256, 512], optimizer)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.gate("adamw")
def test_coordinate_check_to_1024(optimizer):
    check_coordinates([64, 128, 256, 512, 1024], optimizer)


def multipliers_by_name(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, tuple[float, float]]:
    """{parameter name: (its group's LR / 1e-3, weight decay / 0.1)}, rounded to 9 digits."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: (round(g["lr"] / 1e-3, 9), round(g["weight_decay"] / 0.1, 9))
            for g in opt.param_groups for p in g["params"]}


def test_same_multipliers_as_the_mup_package():
    """The ``mup`` package (1.0.0: ``set_base_shapes`` + ``MuAdamW`` + ``MuReadout``) on the same
    dense model gives every parameter the LR, weight decay and init scale we give it, and the same
    output multiplier."""
    mup = pytest.importorskip("mup")
    overrides = ["model.dim=256", "model.n_layers=2", "model.n_heads=4", "optimizer.lr=1e-3",
                 "optimizer.param_groups=[]", "parametrization=mup", f"parametrization.base_width={BASE_WIDTH}"]
    cfg, ours, geometry = tiny(overrides)
    base_spec, spec = spec_of(compose_cfg(overrides + [f"model.dim={BASE_WIDTH}"])), spec_of(cfg)
    base, theirs = base_spec.family.build(base_spec.model_args), spec.family.build(spec.model_args)
    for model in (theirs, base):
        model.output = mup.MuReadout(model.args.dim, model.args.vocab_size, bias=False)
    torch.nn.init.ones_(theirs.output.weight)
    mup.set_base_shapes(theirs, base)  # rescales the readout: its init multiplier
    their_init = {"output.weight": theirs.output.weight[0, 0].item()}
    for name, p in theirs.named_parameters():  # mup.init.normal_'s std over the one it was asked for
        if name != "output.weight":
            their_init[name] = p.infshape.width_mult() ** -0.5 if p.infshape.ninf() == 2 else 1.0
    adam = mup.MuAdamW(theirs.parameters(), lr=1e-3, weight_decay=0.1)
    opt = build_optimizer(cfg.optimizer, list(ours.named_parameters()), geometry)
    assert multipliers_by_name(theirs, adam) == multipliers_by_name(ours, opt)
    assert their_init == pytest.approx({n: g.init_mult for n, g in geometry.items()})
    assert theirs.output.output_mult / theirs.output.width_mult() == pytest.approx(ours.logit_mult) == 0.25
    assert {g.role for g in geometry.values()} == {"embedding", "hidden", "input", "output"}


def test_muon_rule_keeps_the_spectral_step():
    """Muon's muP multiplier: 1 for a square hidden matrix under adjust_lr_fn=original (its step
    is already spectral-norm 1), 1/sqrt(m) under match_rms_adamw (whose 0.2 sqrt(max(rows, cols))
    grows with width); a router (fan-out fixed) takes sqrt(1/m) over its adjustment's growth."""
    cfg, model, geometry = tiny(["model.dim=256", "optimizer=muon", "parametrization=mup",
                                 f"parametrization.base_width={BASE_WIDTH}"])
    wq = geometry["layers.0.attention.wq.weight"]
    assert muon_lr_mult(wq, "original") == 1.0 and muon_lr_mult(wq, "match_rms_adamw") == pytest.approx(0.5)
    opt = build_optimizer(cfg.optimizer, list(model.named_parameters()), geometry)
    assert isinstance(opt, OptimizerList)
    muon = next(o for o in opt.optimizers if isinstance(o, Muon))
    lrs = sorted({g["lr"] for g in muon.param_groups})
    # wq/wk/wv/wo and w1/w3 ([768, 256] vs [256, 64]: sqrt(3/4) over sqrt(768/256)): 1/2; w2 ([256, 768]
    # vs [64, 256], fan-in x3): sqrt(4/3) / sqrt(3) = 2/3
    assert lrs == pytest.approx([0.016 / 2, 0.016 * 2 / 3])
    assert all(g["lr"] * g["weight_decay"] == pytest.approx(0.016 * 0.1) for g in muon.param_groups)


def test_roles_of_a_moe_model():
    """Experts (3-D stacks, both fans growing) are hidden; the router (fan-out = experts) is a
    readout: init / m and Adam LR / m; shared experts are hidden."""
    _, _, geometry = tiny(["model=qwen3_moe_debug", "model.dim=128", "model.tie_word_embeddings=false",
                           "model.moe.num_experts=4", "model.moe.expert_dim=32", "parametrization=mup",
                           "parametrization.base_width=32", "+parametrization.base.moe.expert_dim=8"])
    layer = "layers.0.feed_forward."
    assert geometry[layer + "experts.w1"].role == "hidden" and geometry[layer + "experts.w1"].init_mult == 0.5
    assert geometry[layer + "router.gate.weight"].role == "readout"
    assert geometry[layer + "router.gate.weight"].init_mult == 0.25


# Every language family's debug shape at twice its base width, its own width fields (head, FFN,
# expert widths) scaled with it as a real width sweep would: the base's values of those fields.
ALL_ROLES = {"embedding", "hidden", "input", "output"}
FAMILY_BASES = {
    "llama3_debug": [],
    "qwen3_debug": ["+parametrization.base.head_dim=32", "+parametrization.base.ffn_hidden_dim=384"],
    "qwen3_moe_debug": ["+parametrization.base.head_dim=32", "+parametrization.base.moe.expert_dim=64"],
    # MLA: the latent ranks and head widths stay (input / readout roles), the experts scale
    "deepseek_v3_debug": ["+parametrization.base.ffn_hidden_dim=384", "+parametrization.base.moe.expert_dim=128"],
    "gpt_oss_debug": ["+parametrization.base.head_dim=16", "+parametrization.base.moe.expert_dim=128"],
    "llama4_debug": ["+parametrization.base.head_dim=16", "+parametrization.base.ffn_hidden_dim=256",
                     "+parametrization.base.moe.expert_dim=128"],
    # hybrid: the DeltaNet's head widths scale with the model (its head counts stay)
    "qwen3_5_debug": ["+parametrization.base.head_dim=32", "+parametrization.base.ffn_hidden_dim=384",
                      "+parametrization.base.linear_key_head_dim=16", "+parametrization.base.linear_value_head_dim=16"],
    "qwen3_5_moe_debug": ["+parametrization.base.head_dim=32", "+parametrization.base.moe.expert_dim=64",
                          "+parametrization.base.linear_key_head_dim=16",
                          "+parametrization.base.linear_value_head_dim=16"],
}


@pytest.mark.parametrize("model", sorted(FAMILY_BASES))
def test_every_language_family_gets_its_roles(model):
    """Dense and MoE families: embeddings, hidden matrices (3-D expert stacks included), norms and
    biases, the head; routers are readouts (fan-out = the expert count): init and Adam LR / m."""
    cfg = compose_cfg([f"model={model}", "model.tie_word_embeddings=false", "parametrization=mup",
                       "parametrization.base_width=128", *FAMILY_BASES[model]])
    spec = spec_of(cfg)
    geometry = instantiate(cfg.parametrization, _convert_="all").geometry(spec.family, spec.model_args)
    routers = {n: g for n, g in geometry.items() if n.endswith("router.gate.weight")}
    experts = {n: g for n, g in geometry.items() if ".experts.w" in n and not n.endswith("bias")}
    assert bool(routers) == bool(experts) == ("moe" in cfg.model)
    assert {g.role for g in routers.values()} <= {"readout"} and {g.init_mult for g in routers.values()} <= {0.5}
    assert {g.role for g in experts.values()} <= {"hidden"}
    assert ALL_ROLES <= {g.role for g in geometry.values()}
    assert geometry["output.weight"].init_mult == pytest.approx(2**0.5) and spec.model_args.logit_mult == 0.5


def test_mup_at_its_base_width_is_sp_bit_for_bit(tmp_path):
    """Every multiplier is 1 at base_width: the same losses to the last bit (the LR tuned there
    under sp is the one that transfers)."""
    base = ["model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "training.seq_len=32",
            "training.local_batch_size=2", "training.steps=3", "training.mixed_precision=fp32",
            "training.val_freq=0", "lr_scheduler.warmup_steps=1", "data.max_documents=20", "logger=minimal",
            "cluster.threads_per_proc=1"]
    sp = run(spec_of(compose_cfg(base)), str(tmp_path / "sp"))
    mup = run(spec_of(compose_cfg(base + ["parametrization=mup", "parametrization.base_width=32"])),
              str(tmp_path / "mup"))
    assert mup["losses"] == sp["losses"]


def test_completep_scales_residual_branches():
    cfg = compose_cfg(["parametrization=completep", "parametrization.base_width=128", "parametrization.base_depth=3"])
    spec = spec_of(cfg)
    args = spec.model_args
    assert (args.residual_mult, args.logit_mult) == (0.5, 0.5) and args.attn_mult == pytest.approx(0.5**0.5)
    assert cfg.model.residual_mult == 1.0  # the config stays as composed
    # in the spec's model node: every rebuild of the run's model (registry.build_model) agrees
    assert spec.model_node["residual_mult"] == 0.5
    for model in (spec.family.build(args), build_model(spec.model_node)[1]):
        assert {b.residual_mult for b in model.layers.values()} == {0.5}
        assert {b.attention.score_mult for b in model.layers.values()} == {args.attn_mult}


@pytest.mark.parametrize("overrides,message", [
    (["parametrization=mup"], "parametrization=mup needs parametrization.base_width"),
    (["parametrization=completep", "parametrization.base_width=64"], "needs parametrization.base_depth"),
    (["parametrization=mup", "parametrization.base_width=64", "model=qwen3_debug"], "model.tie_word_embeddings=false"),
    (["parametrization=mup", "parametrization.base_width=64", "+parametrization.base.dimm=3"], "no field 'dimm'"),
])
def test_bad_settings_are_one_line(overrides, message):
    with pytest.raises(UserError, match=message):
        spec_of(compose_cfg(overrides))


def test_an_optimizer_without_a_width_rule_is_refused():
    cfg, model, geometry = tiny(["optimizer=sgd", "parametrization=mup", "parametrization.base_width=64"])
    with pytest.raises(ConfigError, match="width rules for Adam, AdamW and Muon; .* SGD"):
        build_optimizer(cfg.optimizer, list(model.named_parameters()), geometry)
    cfg, model, geometry = tiny(["optimizer=muon", "optimizer.param_groups.0.match=[*]",
                                 "parametrization=mup", "parametrization.base_width=64"])
    with pytest.raises(ConfigError, match="no Muon width rule"):
        build_optimizer(cfg.optimizer, list(model.named_parameters()), geometry)


def test_sp_reads_no_base_and_sets_nothing():
    assert Parametrization().geometry(None, None) == {}
    cfg = compose_cfg([])
    assert (cfg.model.logit_mult, cfg.model.attn_mult, cfg.model.residual_mult) == (1.0, 1.0, 1.0)
    spec_of(cfg)
    assert cfg.model.logit_mult == 1.0


MUP = ("parametrization=mup", "parametrization.base_width=32")  # on the layout tests' 64-wide model: m = 2


@pytest.mark.slow
def test_fsdp_layout_equals_one_process(run_cache, tmp_path, record_property):
    """The multipliers follow the parameter, not the rank: fsdp(2) trains the mup model as one process
    does (measured max |loss diff| 4.8e-7, fp32)."""
    losses = run_layout(tmp_path, ["parallelism=fsdp", *MUP], nproc=2, dp=2)
    assert_parity(losses, reference_losses(run_cache, MUP), atol=parity_bound(run_cache, MUP), label="mup fsdp_2", record=record_property)
    assert losses != reference_losses(run_cache)  # and mup trained another model than sp


CKPT = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "training.seq_len=32",
        "training.local_batch_size=2", "training.steps=6", "training.mixed_precision=fp32",
        "training.deterministic=true", "training.val_freq=0", "lr_scheduler.warmup_steps=2",
        "data.max_documents=40", "logger=minimal", "cluster.threads_per_proc=1", "checkpoint=default",
        "checkpoint.interval=2", "optimizer=muon", *MUP]


@pytest.mark.slow
def test_exact_resume(tmp_path):
    """4 steps + resume + 2 == 6 steps, bit for bit, with the split Muon / AdamW groups."""
    ref = run(spec_of(compose_cfg(CKPT)), str(tmp_path / "ref"), return_state=True)
    shutil.copytree(tmp_path / "ref" / "checkpoint", tmp_path / "resumed" / "checkpoint")
    shutil.rmtree(tmp_path / "resumed" / "checkpoint" / "step-6")
    resumed = run(spec_of(compose_cfg(CKPT)), str(tmp_path / "resumed"), return_state=True)
    assert resumed["losses"] == ref["losses"]
    for k, v in ref["full_state"].items():
        assert torch.equal(resumed["full_state"][k], v), k


@pytest.mark.parametrize("model", ["llama3_debug", "qwen3_debug"])
def test_hf_export_folds_the_multipliers(tmp_path, model):
    """An exported mup model gives transformers the same logits: the logit multiplier is folded
    into lm_head, the attention one into the queries (Llama: q_proj; Qwen3: its q_norm weight)."""
    from transformers import AutoModelForCausalLM  # here: the module's other tests skip its import

    # Qwen3's head_dim is its own field: a base head_dim makes its attention multiplier 1/sqrt(2) too
    _, ours, _ = tiny([f"model={model}", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
                       "model.tie_word_embeddings=false", "model.vocab_size=256", *MUP]
                      + (["model.head_dim=32", "+parametrization.base.head_dim=16"] if model == "qwen3_debug" else []))
    family = spec_of(compose_cfg([f"model={model}"])).family
    assert ours.logit_mult == 0.5 and ours.args.attn_mult != 1.0
    marker = {"format": FORMAT_VERSION, "step": 1, "kind": "full",
              "model": {"family": family.name, "flavor": "custom", "args": family.args_fields(ours.args),
                        "signature": family.signature(ours.args)}}
    save_plain(tmp_path / "step-1", {f"model.{k}": v.clone() for k, v in ours.state_dict().items()}, marker)
    convert.to_hf(tmp_path / "step-1", tmp_path / "hf")
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()(tokens).logits
        diff = (theirs - ours(tokens)).abs().max().item()
    assert diff < 1e-4, diff


def test_hf_export_of_completep_is_refused():
    from titan_hydra.models.common.hf_decoder import HFConversionError

    cfg = compose_cfg(["parametrization=completep", "parametrization.base_width=128", "parametrization.base_depth=3"])
    spec = spec_of(cfg)
    with pytest.raises(HFConversionError, match="residual_mult=0.5 .* has no counterpart in transformers"):
        spec.family.hf.to_hf_state({}, spec.model_args)


def test_hf_export_of_a_mup_hybrid_is_refused():
    """Qwen3.5's queries hold the output gate and its QK-norm scales by (1 + w): nothing folds the
    attention multiplier, so export refuses instead of writing a model with other logits."""
    from titan_hydra.models.common.hf_decoder import HFConversionError

    cfg = compose_cfg(["model=qwen3_5_debug", "parametrization=mup", "parametrization.base_width=128",
                       "+parametrization.base.head_dim=32"])
    spec = spec_of(cfg)
    assert spec.model_args.attn_mult != 1.0
    with pytest.raises(HFConversionError, match="attn_mult=.* has no counterpart in transformers' Qwen3.5"):
        spec.family.hf.to_hf_state({}, spec.model_args)
