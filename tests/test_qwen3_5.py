"""Qwen3.5 (dense and MoE, text model): logits equal transformers' Qwen3_5ForCausalLM /
Qwen3_5MoeForCausalLM (its torch path) both ways through convert.py, the layer pattern as a config
value, decoding with the Gated DeltaNet state, and the layout rules (CP, MoE TP and a TP that splits a
Gated DeltaNet head refused in one line; the TP plan's keys)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import compose_cfg, model_logits

from titan_hydra.checkpoint import convert  # noqa: E402  (read_model, to_hf, from_hf)
from titan_hydra.checkpoint.state import FORMAT_VERSION  # noqa: E402
from titan_hydra.checkpoint.storage import save_plain  # noqa: E402
from titan_hydra.errors import ConfigError  # noqa: E402
from titan_hydra.models.common.hf_decoder import HFConversionError  # noqa: E402
from titan_hydra.models.qwen3_5 import FAMILY as QWEN35  # noqa: E402
from titan_hydra.models.qwen3_5 import Qwen35  # noqa: E402
from titan_hydra.models.qwen3_5_moe import FAMILY as QWEN35_MOE  # noqa: E402
from titan_hydra.models.qwen3_5_moe import Qwen35Moe  # noqa: E402
from titan_hydra.models.qwen3_next import FAMILY as QWEN3_NEXT  # noqa: E402
from titan_hydra.models.registry import args_of  # noqa: E402
from numerics import U32, assert_fp32_close  # noqa: E402

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_5 import modeling_qwen3_5  # noqa: E402
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe  # noqa: E402
from transformers.models.qwen3_next import modeling_qwen3_next  # noqa: E402

VOCAB = 128
TOKENS = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
HF_CLASSES = {"qwen3_5_text": transformers.Qwen3_5ForCausalLM, "qwen3_5_moe_text": transformers.Qwen3_5MoeForCausalLM,
              "qwen3_next": transformers.Qwen3NextForCausalLM}
FAMILIES = {"qwen3_5_text": QWEN35, "qwen3_5_moe_text": QWEN35_MOE, "qwen3_next": QWEN3_NEXT}
# 4 layers: linear, full, linear, full (both mixers twice); GQA 4/2 x 32 with a quarter rotating
# (8 channels), DeltaNet 2 key / 4 value heads x 16, 4 experts of width 48 top-2 + a gated shared one.
LAYERS = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, max_position_embeddings=64, rms_norm_eps=1e-6, layer_types=LAYERS,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              initializer_range=0.1, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                      "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1]})
HF_EXTRA = {"qwen3_5_text": dict(intermediate_size=96),
            "qwen3_5_moe_text": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                     shared_expert_intermediate_size=48)}
HF_EXTRA["qwen3_next"] = HF_EXTRA["qwen3_5_moe_text"]
OURS = dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=VOCAB, max_seq_len=64,
            rope_theta=10000.0, layer_types=LAYERS, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_chunk_size=8)
OUR_MOE = dict(num_experts=4, top_k=2, expert_dim=48, num_shared_experts=1, route_norm=True, load_balance_coeff=0.0)
KINDS = list(HF_CLASSES)
# Logits of two fp32 computations, neither with an fp64 form (norms and rotary compute in fp32 whatever
# the dtype; transformers' DeltaNet casts to fp32 inside): bounded from first principles, fp32 unit
# roundoff times 4e3 terms (4 layers whose sums along the path have <= 1000 terms: dim 64, FFN 96,
# 16 tokens, the DeltaNet's chunked products) of the largest logit. Measured: docs/families.md (Qwen3.5).
TINY_REL = 4e3 * U32


@pytest.fixture(autouse=True)
def torch_path(monkeypatch):
    """transformers' torch forms of the DeltaNet even where flash-linear-attention is installed."""
    for module in (modeling_qwen3_5, modeling_qwen3_5_moe, modeling_qwen3_next):
        for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn"):
            if hasattr(module, name):
                fn = getattr(module, name)
                monkeypatch.setattr(module, name, getattr(fn, "__wrapped__", fn))


def randomize(model: torch.nn.Module) -> None:
    """Norm weights, decays and shared-expert gates away from their init, so a swapped name shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 or name.endswith(("A_log", "dt_bias", "shared_expert_gate.weight", "shared_experts.gate.weight")):
                p.add_(0.3 * torch.randn_like(p))


def hf_logits(kind: str, path: Path) -> torch.Tensor:
    model = HF_CLASSES[kind].from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(TOKENS).logits


def our_logits(ckpt: Path) -> torch.Tensor:
    return model_logits(*convert.read_model(ckpt), TOKENS)


@pytest.mark.parametrize("kind", KINDS)
def test_hf_to_ours_to_hf(tmp_path, kind, record_property):
    """HF -> ours -> HF is tensor-identical; our model reproduces HF's logits."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    hf = HF_CLASSES[kind](HF_CLASSES[kind].config_class(**COMMON, **HF_EXTRA[kind]))
    randomize(hf)
    hf.save_pretrained(tmp_path / "hf")
    convert.from_hf(tmp_path / "hf", tmp_path / "ckpt" / "step-0")
    family, args, sd = convert.read_model(tmp_path / "ckpt" / "step-0")
    assert family is FAMILIES[kind] and args.layer_types == LAYERS and args.rotary_dim == 8
    # transformers' fused q | k | v (2 key heads x 16, twice, then 4 value heads x 16) split into parts
    assert [sd[f"layers.0.linear_attn.conv_{p}.weight"].shape for p in "qkv"] == [(32, 1, 4), (32, 1, 4), (64, 1, 4)]
    assert sd["layers.0.linear_attn.in_proj_v.weight"].shape == (64, 64)
    assert sd["layers.1.attention.wq.weight"].shape == (2 * 4 * 32, 64)  # query + gate per head
    convert.to_hf(tmp_path / "ckpt" / "step-0", tmp_path / "back")
    a, b = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ref = hf_logits(kind, tmp_path / "hf")
    diff = (our_logits(tmp_path / "ckpt" / "step-0") - ref).abs().max().item()
    record_property(f"{kind} HF -> ours max |logit diff|", diff)
    assert diff <= TINY_REL * ref.abs().max().item(), diff
    cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    assert cfg["model_type"] == kind and cfg["layer_types"] == LAYERS


@pytest.mark.parametrize("kind", KINDS)
def test_ours_to_hf_to_ours(tmp_path, kind, record_property):
    """A checkpoint of our model exports to HF (same logits there) and re-imports with equal logits."""
    torch.manual_seed(0)
    model = Qwen35(**OURS, ffn_hidden_dim=96) if kind == "qwen3_5_text" else Qwen35Moe(**OURS, moe=OUR_MOE)
    model.init_weights()
    randomize(model)
    family = FAMILIES[kind]
    marker = {"format": FORMAT_VERSION, "step": 3, "kind": "full",
              "model": {"family": family.name, "flavor": "custom", "args": family.args_fields(model.args),
                        "signature": family.signature(model.args)}}
    save_plain(tmp_path / "step-3", {f"model.{k}": v.clone() for k, v in model.state_dict().items()}, marker)
    before = our_logits(tmp_path / "step-3")
    convert.to_hf(tmp_path / "step-3", tmp_path / "hf")
    diff = (hf_logits(kind, tmp_path / "hf") - before).abs().max().item()
    record_property(f"{kind} ours -> HF max |logit diff|", diff)
    assert diff <= TINY_REL * before.abs().max().item(), diff
    convert.from_hf(tmp_path / "hf", tmp_path / "again" / "step-0")
    again = our_logits(tmp_path / "again" / "step-0")  # chunk size 64 on import: same function, other rounding
    assert_fp32_close({"logits": again}, {"logits": before}, rel=TINY_REL)


# ------------------------------------------------------------------------------- layer pattern


def debug(name: str, *overrides: str):
    return args_of(compose_cfg([f"model={name}", *(f"model.{o}" for o in overrides)]).model)


def test_layer_pattern_from_interval_or_list():
    """``full_attention_interval`` k: every k-th layer full (HF's rule; 0 = none); an explicit list wins."""
    kinds = {k: "".join("F" if t == "full_attention" else "L" for t in debug("qwen3_5_debug", f"full_attention_interval={k}")[1].layer_kinds)
             for k in (0, 1, 2, 4, 8)}
    assert kinds == {0: "LLLLLLLL", 1: "FFFFFFFF", 2: "LFLFLFLF", 4: "LLLFLLLF", 8: "LLLLLLLF"}
    family, args = debug("qwen3_5_moe_debug", "layer_types=[full_attention,linear_attention,linear_attention,full_attention]")
    assert args.layer_kinds == ["full_attention", "linear_attention", "linear_attention", "full_attention"]
    with torch.device("meta"):
        model = family.build(args)
    assert [hasattr(b, "attention") for b in model.layers.values()] == [True, False, False, True]
    assert [hasattr(b, "linear_attn") for b in model.layers.values()] == [False, True, True, False]
    # the pattern is part of what the weights mean: a checkpoint of another pattern is refused
    assert family.signature(args) != family.signature(debug("qwen3_5_moe_debug")[1])
    assert QWEN35.signature(debug("qwen3_5_debug")[1]) == QWEN35.signature(debug(
        "qwen3_5_debug", "layer_types=[" + ",".join((["linear_attention"] * 3 + ["full_attention"]) * 2) + "]")[1])


@pytest.mark.parametrize("override,message", [
    ("layer_types=[linear_attention,sliding_attention,linear_attention,full_attention]",
     r"model.layer_types has unknown types \['sliding_attention'\]"),
    ("layer_types=[linear_attention,full_attention]", r"model.layer_types has 2 entries but model.n_layers=4"),
    ("full_attention_interval=-1", r"model.full_attention_interval=-1 must be >= 0"),
])
def test_bad_layer_pattern_is_one_line(override, message):
    with pytest.raises(ConfigError, match=message) as err:
        debug("qwen3_5_moe_debug", override)
    assert "\n" not in str(err.value)


def test_flops_count_attention_only_in_full_layers():
    """A DeltaNet layer's work is linear in the sequence, a full layer's quadratic: at 8k tokens the
    all-linear pattern costs less than the 3:1 hybrid, which costs less than all-full attention."""
    flops = {k: QWEN35.flops_per_token(debug("qwen3_5_debug", f"full_attention_interval={k}")[1], 8192)
             for k in (0, 4, 1)}
    assert flops[0] < flops[4] < flops[1]
    short = {k: QWEN35.flops_per_token(debug("qwen3_5_debug", f"full_attention_interval={k}")[1], 256) for k in (0, 4)}
    assert (flops[4] - flops[0]) / (short[4] - short[0]) > 20  # the full layers' term grows with the sequence


@pytest.mark.parametrize("name,overrides,message", [
    ("qwen3_5_debug", ["parallelism.tp=2", "model.linear_num_key_heads=1"],
     r"parallelism.tp=2 must divide model.linear_num_key_heads=1 \(each rank keeps whole Gated DeltaNet heads\)"),
    ("qwen3_5_moe_debug", ["parallelism.tp=2"], r"parallelism.tp=2 is not supported for Mixture-of-Experts models"),
    ("qwen3_5_debug", ["parallelism.cp=2"], r"parallelism.cp=2 is not supported for qwen3_5 with linear_attention"),
])
def test_layouts_refused_in_one_line(name, overrides, message):
    from titan_hydra.validate import validate

    cfg = compose_cfg([f"model={name}", *overrides, "cluster.nproc_per_node=2"])
    with pytest.raises(ConfigError, match=message) as err:
        validate(cfg)
    assert "\n" not in str(err.value)


def test_tp_plan_shards_every_gated_deltanet_part():
    """The hybrid's TP plan (built on meta, no process group): the DeltaNet block's input is gathered
    and every one of its parameters is sharded by some entry (projections column-wise, out_proj
    row-wise, the norm on the local heads, the directly read convolutions / decays by one input
    style); the full-attention block keeps the decoder's entries. And tp=2 validates for the flavor."""
    from titan_hydra.validate import validate

    family, args = debug("qwen3_5_debug", "n_layers=2", "full_attention_interval=2")
    with torch.device("meta"):
        model = family.build(args)
    plan = family.tp_plan(model, sequence_parallel=True, loss_parallel=True)
    linear = {k.removeprefix("layers.0.linear_attn"): type(v).__name__ for k, v in plan.items()
              if k.startswith("layers.0.linear_attn")}
    assert linear == {"": "PrepareInputShardParams", ".norm": "HeadShardedNorm", ".out_proj": "RowwiseParallel",
                      **{f".in_proj_{w}": "ColwiseParallel" for w in "qkvzab"}}
    direct = set(plan["layers.0.linear_attn"].params)
    assert direct == {"conv_q.weight", "conv_k.weight", "conv_v.weight", "dt_bias", "A_log"}
    for name, _ in model.layers["0"].linear_attn.named_parameters():
        assert name in direct or "." + name.rpartition(".")[0] in linear, name
    assert {"layers.1.attention.wq", "layers.1.attention.q_norm", "layers.0.feed_forward.w1"} <= plan.keys()
    assert "layers.0.attention" not in plan
    assert not any(k.startswith(("layers.0.attention.", "layers.1.linear_attn")) for k in plan)
    validate(compose_cfg(["model=qwen3_5_debug", "parallelism=tp", "cluster.nproc_per_node=2"]))


def test_run_header_names_the_delta_kernel_and_why(tmp_path, capsys):
    """A hybrid run's header says what runs the Gated DeltaNet layers and why (auto on CPU: torch)."""
    from titan_hydra.spec import spec_of
    from titan_hydra.train.pretrain import run

    cfg = compose_cfg(["model=qwen3_5_debug", "model.dim=64", "model.n_layers=2", "model.full_attention_interval=2",
                       "training.seq_len=32", "training.local_batch_size=2", "training.steps=2", "training.val_freq=0",
                       "data.max_documents=40", "logger=minimal", "cluster.threads_per_proc=1"])
    capsys.readouterr()
    losses = run(spec_of(cfg), str(tmp_path / "run"))["losses"]
    header = capsys.readouterr().out
    assert len(losses) == 2 and all(l == l for l in losses)
    assert ("linear attn  gated delta rule: torch (auto: flash-linear-attention does not apply (its kernels are "
            "Triton on CUDA and this run is on cpu))") in header, header[:2000]


def test_conversions_refuse_what_the_other_side_cannot_express():
    """One line each: the multimodal checkpoint, attention biases, Qwen3-Next dense layers, and an MoE
    export whose routing HF's class would compute differently."""
    hf_cfg = {**COMMON, **HF_EXTRA["qwen3_5_moe_text"], "model_type": "qwen3_5_moe_text"}
    moe = debug("qwen3_5_moe_debug")[1]
    cases = [
        (lambda: QWEN35.hf.args_from_hf_config({"model_type": "qwen3_5", "text_config": {}}),
         r"config.json is the multimodal Qwen3.5 \(qwen3_5\); save its text model"),
        (lambda: QWEN35_MOE.hf.args_from_hf_config({**hf_cfg, "attention_bias": True}), "attention_bias=true"),
        (lambda: QWEN3_NEXT.hf.args_from_hf_config({**hf_cfg, "model_type": "qwen3_next", "mlp_only_layers": [0]}),
         "makes some Qwen3-Next layers dense"),
        (lambda: QWEN35_MOE.hf.args_from_hf_config({**hf_cfg, "shared_expert_intermediate_size": 72}),
         "not a multiple of moe_intermediate_size=48"),
        (lambda: QWEN35_MOE.hf.hf_config(debug("qwen3_5_moe_debug", "moe.num_shared_experts=0")[1]),
         "num_shared_experts=0"),
    ]
    with torch.device("meta"):
        sd = QWEN35_MOE.build(moe).state_dict()
    sd["layers.0.feed_forward.expert_bias"] = torch.ones(8)
    cases.append((lambda: QWEN35_MOE.hf.to_hf_state({k: v for k, v in sd.items() if "expert_bias" in k}, moe),
                  "load_balance_coeff=0"))
    for call, message in cases:
        with pytest.raises(HFConversionError, match=message) as err:
            call()
        assert "\n" not in str(err.value)
