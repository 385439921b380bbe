"""The model-family protocol as the engine sees it: the registry, args from config nodes,
shape/signature/check rules, layout plans and HF config round trips, for Llama and Qwen3."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from helpers import compose_cfg

from titan_hydra.errors import ConfigError
from titan_hydra.models.common.hf_decoder import HFConversionError
from titan_hydra.models.llama3 import FAMILY as LLAMA
from titan_hydra.models.llama3 import LlamaArgs
from titan_hydra.data.settings import DataSettings
from titan_hydra.models.protocol import (DrawsSamples, LimitsSimulation, ModelFamily, RunsStepHooks, ShardsRope,
                                         SizesSamples, WeighsLosses)
from titan_hydra.models.qwen3 import FAMILY as QWEN3
from titan_hydra.models.registry import BUILTIN, args_of, build_model, family_for_hf_type, get_family
from titan_hydra.config.eval import EvalSettings


def debug(name: str, *overrides: str):
    return args_of(compose_cfg([f"model={name}", *(f"model.{o}" for o in overrides)]).model)


# ------------------------------------------------------------------------------- registry


def test_registry_resolves_builtin_names_and_dotted_paths():
    assert set(BUILTIN) == {"llama3", "qwen3", "qwen3_moe", "deepseek_v3", "gpt_oss", "llama4", "qwen3_5", "qwen3_5_moe",
                            "qwen3_next", "flux", "hf"}
    assert get_family("llama3") is LLAMA and get_family("qwen3") is QWEN3
    assert get_family("titan_hydra.models.qwen3.FAMILY") is QWEN3
    made = get_family("titan_hydra.models.deepseek_v3.DeepSeekV3Family")  # a class is instantiated
    assert isinstance(made, ModelFamily) and made.name == "deepseek_v3"
    for bad in ("gpt5", "titan_hydra.models.qwen3.Qwen3", "no.such.module.FAMILY"):
        with pytest.raises(ConfigError, match="neither a built-in family") as err:
            get_family(bad)
        assert "\n" not in str(err.value)
    assert family_for_hf_type("llama") is LLAMA and family_for_hf_type("qwen3") is QWEN3
    assert family_for_hf_type("FluxTransformer2DModel").name == "flux"  # diffusers names it in _class_name
    with pytest.raises(HFConversionError, match=r"model_type='vit' is not supported \(known: llama, qwen3, qwen3_moe, deepseek_v3, gpt_oss, llama4_text, qwen3_5_text, qwen3_5_moe_text, qwen3_next, FluxTransformer2DModel; or any transformers causal LM\)"):
        family_for_hf_type("vit")
    assert family_for_hf_type("gemma").name == "hf"  # no native port: transformers' own class


def test_args_of_reports_bad_nodes_in_one_line():
    with pytest.raises(ConfigError, match="no `family` key"):
        args_of({"_target_": "titan_hydra.models.qwen3.Qwen3", "dim": 64})
    with pytest.raises(ConfigError, match="does not fit family 'qwen3'"):
        args_of({"family": "qwen3", "dim": 64, "multiple_of": 256})
    with pytest.raises(ConfigError, match="n_kv_heads=3") as err:
        args_of({"family": "qwen3", "dim": 64, "n_layers": 1, "n_heads": 8, "n_kv_heads": 3, "head_dim": 8,
                 "ffn_hidden_dim": 64, "vocab_size": 64, "max_seq_len": 32})
    assert "\n" not in str(err.value)
    family, args = debug("qwen3_debug")
    assert family is QWEN3 and args.head_dim == 64
    # markers store args_fields; make_args inverts it
    for family, args in (debug("llama3_debug"), debug("qwen3_debug")):
        assert family.make_args(family.args_fields(args)) == args


def test_build_model_uses_target_and_fields():
    cfg = compose_cfg(["model=qwen3_debug", "model.n_layers=1"])
    with torch.device("meta"):
        family, model = build_model(cfg.model)
    assert family is QWEN3 and type(model).__name__ == "Qwen3" and model.args.n_layers == 1
    assert family.blocks(model) is model.layers


# ------------------------------------------------------------------------------- shape / signature


def test_shape_of_qwen3_debug():
    s = QWEN3.shape(debug("qwen3_debug")[1])
    assert (s.dim, s.n_heads, s.n_kv_heads, s.head_dim, s.q_dim, s.kv_dim) == (256, 8, 4, 64, 512, 256)
    assert s.tied_embeddings and s.params == s.active_params == 6_426_624
    assert s.embedding_params == 2048 * 256 and s.head_params == 256 + 2048 * 256
    # one block: wq 256x512, wk/wv 256x256, wo 512x256, QK-norm 2x64, SwiGLU 3x256x768, 2 norms
    assert s.block_params == 256 * 512 * 2 + 2 * 256 * 256 + 128 + 3 * 256 * 768 + 512
    untied = QWEN3.shape(debug("qwen3_debug", "tie_word_embeddings=false")[1])
    assert untied.params == s.params + 2048 * 256 and untied.block_params == s.block_params


def test_signature_decides_weight_compatibility():
    _, args = debug("qwen3_debug")
    sig = QWEN3.signature(args)
    assert sig["family"] == "qwen3" and sig["head_dim"] == 64 and sig["qk_norm"] is True
    # length and init-only fields may differ
    assert QWEN3.signature(dataclasses.replace(args, max_seq_len=64, depth_init=False)) == sig
    for change in ({"qk_norm": False}, {"head_dim": 32}, {"tie_word_embeddings": False},
                   {"rope_theta": 10000.0}, {"ffn_hidden_dim": 512}):
        assert QWEN3.signature(dataclasses.replace(args, **change)) != sig, change
    # Llama: two spellings of one FFN width are one shape
    a = LlamaArgs(dim=4096, n_layers=2, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024,
                  vocab_size=128, max_seq_len=64)
    b = LlamaArgs(dim=4096, n_layers=2, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=None, multiple_of=14336,
                  vocab_size=128, max_seq_len=64)
    assert a.ffn_hidden_dim == b.ffn_hidden_dim == 14336
    assert LLAMA.signature(a) == LLAMA.signature(b)
    assert LLAMA.signature(a)["family"] != QWEN3.signature(args)["family"]


@pytest.mark.parametrize("dims,seq,expected", [
    ({"tp": 8}, 256, "must divide model.n_heads=8 and n_kv_heads=4"),
    ({"pp": 7}, 256, "pp=7 exceeds model.n_layers=6"),
    ({"pp": 2}, 256, "tie_word_embeddings=true cannot run under pipeline parallel"),
    ({}, 4096, "training.seq_len=4096 exceeds model.max_seq_len=2048"),
])
def test_check_rules(dims, seq, expected):
    _, args = debug("qwen3_debug")
    layout = SimpleNamespace(**{"tp": 1, "pp": 1, **dims})
    with pytest.raises(ConfigError, match=expected) as err:
        QWEN3.check(args, layout, seq)
    assert "\n" not in str(err.value)


def test_check_accepts_what_the_family_can_run():
    _, args = debug("qwen3_debug")
    QWEN3.check(args, SimpleNamespace(tp=4, pp=1), 2048)
    QWEN3.check(dataclasses.replace(args, tie_word_embeddings=False), SimpleNamespace(tp=2, pp=2), 256)
    LLAMA.check(debug("llama3_debug")[1], SimpleNamespace(tp=16, pp=6), 256)


# ------------------------------------------------------------------------------- layout


@pytest.mark.parametrize("tied", [True, False])
def test_fsdp_units(tied):
    _, args = debug("qwen3_debug", f"tie_word_embeddings={str(tied).lower()}")
    with torch.device("meta"):
        model = QWEN3.build(args)
    units = QWEN3.fsdp_units(model)
    blocks = [u for u, _ in units if u in list(model.layers.values())]
    assert len(blocks) == 6 and [last for _, last in units].count(True) == 1 and units[-1][1]
    if tied:  # one parameter belongs to one unit: the embedding goes with the head
        assert units[-1][0] == [model.tok_embeddings, model.norm, model.output] and len(units) == 7
    else:
        assert units[0] == (model.tok_embeddings, False) and units[-1][0] == [model.norm, model.output]
    per_unit = [{id(p) for m in (u if isinstance(u, list) else [u]) for p in m.parameters()} for u, _ in units]
    seen = [i for ids in per_unit for i in ids]
    assert len(seen) == len(set(seen)) == len(list(model.parameters()))  # every parameter in one unit


def test_tp_plan_shards_qk_norm_per_head_for_qwen3_only():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from titan_hydra.models.common.tp_styles import HeadShardedNorm

    with torch.device("meta"):
        qwen = QWEN3.build(debug("qwen3_debug", "n_layers=1")[1])
        llama = LLAMA.build(debug("llama3_debug", "n_layers=1")[1])
    qplan, lplan = QWEN3.tp_plan(qwen, True, True), LLAMA.tp_plan(llama, True, True)
    assert isinstance(qplan["layers.0.attention.q_norm"], HeadShardedNorm)
    assert isinstance(qplan["layers.0.attention.k_norm"], HeadShardedNorm)
    assert not any("q_norm" in k for k in lplan)
    for plan in (qplan, lplan):
        assert isinstance(plan["layers.0.attention.wq"], ColwiseParallel)
        assert isinstance(plan["layers.0.attention.wo"], RowwiseParallel)
        assert isinstance(plan["output"], ColwiseParallel)
    # every planned module exists
    for model, plan in ((qwen, qplan), (llama, lplan)):
        names = dict(model.named_modules())
        assert all(k in names for k in plan), [k for k in plan if k not in names]


def test_cut_stage_keeps_fqns_and_leaves_the_model_alone():
    _, args = debug("qwen3_debug", "tie_word_embeddings=false")
    with torch.device("meta"):
        model = QWEN3.build(args)
    middle = QWEN3.cut_stage(model, range(2, 4), is_first=False, is_last=False)
    assert list(middle.layers) == ["2", "3"]
    assert middle.tok_embeddings is None and middle.norm is None and middle.output is None
    assert {n for n, _ in middle.named_parameters()} <= {n for n, _ in model.named_parameters()}
    assert len(model.layers) == 6 and model.output is not None


# ------------------------------------------------------------------------------- capabilities


def test_drawing_pictures_is_a_capability_a_family_opts_into():
    """``sample_images`` is no member of ModelFamily: the image family implements DrawsSamples, the
    language families do not, and a bring-your-own family gets it by defining the method alone."""
    assert not hasattr(ModelFamily, "sample_images")
    assert [n for n in BUILTIN if isinstance(get_family(n), DrawsSamples)] == ["flux"]

    class Painter(ModelFamily):  # names no capability class: the protocol is structural
        name = "painter"

        def build(self, args):  # the pictures are drawn by a full copy of the model
            return torch.nn.Identity()

        def sample_images(self, model, dataset, prompts, steps, guidance, seed):
            return torch.zeros(len(prompts), 4, 4, 3, dtype=torch.uint8)

    pictures = EvalSettings(sample_every=5, sample_prompts=["a cat"])
    pictures.check(Painter())
    with pytest.raises(ConfigError, match=r"eval\.sample_every=5: model family 'llama3' draws no sample pictures"):
        pictures.check(LLAMA)


def test_optional_members_are_capabilities_the_engine_checks():
    """What only some families have is no member of ModelFamily: Flux sizes its own samples from
    the typed data settings, the decoders weigh their MoE losses and the native ones shard rope tables (hf: no CP), and a
    family without a capability gets the engine's default (a sample is seq_len tokens)."""
    from titan_hydra.layout import check_layout
    from titan_hydra.planner.plan import plan
    from titan_hydra.spec import spec_of
    from titan_hydra.train.model_build import flops_per_unit

    for member in ("sample_tokens", "flops_per_sample", "flops_per_unit", "check_data", "rope_buffers",
                   "set_loss_scale", "step_hooks"):
        assert not hasattr(ModelFamily, member), member
    assert [n for n in BUILTIN if isinstance(get_family(n), SizesSamples)] == ["flux"]
    assert [n for n in BUILTIN if not isinstance(get_family(n), ShardsRope)] == ["flux", "hf"]
    assert [n for n in BUILTIN if not isinstance(get_family(n), WeighsLosses)] == ["flux"]  # hf: transformers' aux loss
    assert [n for n in BUILTIN if isinstance(get_family(n), RunsStepHooks)] == ["hf"]  # its MoE load metrics
    assert [n for n in BUILTIN if isinstance(get_family(n), LimitsSimulation)] == ["hf"]
    spec = spec_of(compose_cfg(["model=llama3_debug"]))
    assert isinstance(spec.data, DataSettings) and not spec.data.image_data
    check_layout(spec)
    p = plan(spec)
    assert p.tokens_per_sample == spec.batch.seq_len
    assert p.flops_per_token == LLAMA.flops_per_token(spec.model_args, spec.batch.seq_len)
    dataset = SimpleNamespace(seq_len=64)
    assert flops_per_unit(LLAMA, spec.model_args, dataset) == LLAMA.flops_per_token(spec.model_args, 64)


# ------------------------------------------------------------------------------- HF config


@pytest.mark.parametrize("name", ["llama3_debug", "qwen3_debug", "llama3_8b", "qwen3_0.6b", "qwen3_moe_debug",
                                  "qwen3_235b_a22b", "deepseek_v3_debug", "deepseek_v3_671b"])
def test_hf_config_round_trips_to_the_same_signature(name):
    family, args = debug(name)
    cfg = family.hf.hf_config(args, torch.bfloat16)
    assert cfg["dtype"] == "bfloat16" and cfg["model_type"] == family.hf.model_type
    back = family.hf.args_from_hf_config(cfg)
    assert family.signature(back) == family.signature(args)
    assert back.max_seq_len == args.max_seq_len
    if family is QWEN3:
        assert back == dataclasses.replace(args, depth_init=back.depth_init)
