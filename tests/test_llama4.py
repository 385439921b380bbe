"""Llama 4: counts against transformers, chunked attention's exact cut-off, iRoPE (NoPE layers see
the whole context, with temperature-tuned queries), QK-norm after rotary, input-gated experts, Scout's
rotary scaling, family rules, HF refusals, a dry-run plan.
(Logit parity with Llama4ForCausalLM in both directions lives in test_hf_convert.py; training, layout
parity and resume in test_family_training.py; document masking for every family in test_document_mask.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from titan_hydra.spec import spec_of
from helpers import compose_cfg
from titan_hydra.errors import ConfigError
from titan_hydra.models.common.hf_decoder import HFConversionError
from titan_hydra.models.common.moe import MoE, MoEArgs
from titan_hydra.models.common.rotary import inverse_frequencies
from titan_hydra.models.llama4 import FAMILY
from titan_hydra.models.llama4.model import Llama4Attention, rms_normalize
from titan_hydra.models.registry import args_of
from titan_hydra.parallel.parallelism import ParallelDims

from numerics import assert_fp32_only, outputs_and_grads

F32, F64 = torch.float32, torch.float64
EPS32 = torch.finfo(F32).eps


def flavor(name: str, *overrides: str):
    return args_of(compose_cfg([f"model={name}", *(f"model.{o}" for o in overrides)]).model)[1]


# ------------------------------------------------------------------------------- counting


@pytest.mark.parametrize("name,experts,step,qk_norm", [("llama4_scout", 16, 1, True),
                                                        ("llama4_maverick", 128, 2, False)])
def test_parameter_counts_equal_transformers(name, experts, step, qk_norm):
    """Total and active parameters equal Llama4ForCausalLM's on the meta device (published text configs;
    Llama4TextConfig's defaults are Scout's shapes)."""
    transformers = pytest.importorskip("transformers")
    args = flavor(name)
    shape = FAMILY.shape(args)
    with torch.device("meta"):
        hf = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(
            num_local_experts=experts, interleave_moe_layer_step=step, use_qk_norm=qk_norm))
    total = sum(p.numel() for p in hf.parameters())
    routed = sum(p.numel() for n, p in hf.named_parameters() if ".feed_forward.experts." in n)
    active = total - routed * (experts - 1) // experts
    assert (shape.params, shape.active_params) == (total, active)
    assert (shape.n_experts, shape.top_k, shape.moe_layers) == (experts, 1, 48 // step)
    expected = {"llama4_scout": (107_769_861_120, 17_172_894_720),  # "109B total, 17B active"
                "llama4_maverick": (400_711_848_960, 17_184_691_200)}  # "400B total, 17B active"
    assert (shape.params, shape.active_params) == expected[name]
    assert args.nope_layer_ids == list(range(3, 48, 4))


# ------------------------------------------------------------------------------ attention

D, HEADS, KV, HD, S = 32, 4, 2, 8, 12


def attention(use_rope: bool, chunk: int | None = 4, qk_norm: bool = True, temperature=(4.0, 0.5)):
    torch.manual_seed(0)
    attn = Llama4Attention(D, HEADS, KV, HD, use_rope=use_rope, qk_norm=qk_norm, norm_eps=1e-5, chunk_size=chunk,
                           temperature=temperature)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.3)
    angles = torch.outer(torch.arange(S, dtype=torch.float32), 1.0 / 100 ** (torch.arange(0, HD, 2) / HD))
    return attn, angles.cos(), angles.sin()


def interleaved_rope(x, cos, sin):
    pairs = x.unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)


def naive(attn: Llama4Attention, x, cos, sin, chunk, use_rope, qk_norm, temperature):
    """Llama 4 attention written out (HF's order: rotary, then the weightless QK-norm; NoPE: queries
    scaled by 1 + attn_scale * log1p(floor((pos + 1) / floor_scale))). Plain operations in x's dtype,
    so it has an fp64 form (the layer's rotary and norms compute in fp32 whatever the dtype)."""
    b, s, _ = x.shape
    q = (x @ attn.wq.weight.T).view(b, s, -1, HD)
    k = (x @ attn.wk.weight.T).view(b, s, -1, HD)
    v = (x @ attn.wv.weight.T).view(b, s, -1, HD)
    if use_rope:
        q, k = interleaved_rope(q, cos, sin), interleaved_rope(k, cos, sin)
        if qk_norm:
            q = q / q.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()
            k = k / k.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()
    elif temperature:
        floor_scale, scale = temperature
        pos = torch.arange(s, dtype=q.dtype)
        q = q * (1 + scale * torch.log1p(torch.floor((pos + 1) / floor_scale)))[None, :, None, None]
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(HD)
    i = torch.arange(s)
    visible = i[:, None] >= i[None, :]
    if use_rope and chunk:
        visible = visible & (i[:, None] // chunk == i[None, :] // chunk)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, -1) @ attn.wo.weight.T


@pytest.mark.parametrize("use_rope,qk_norm", [(True, True), (True, False), (False, True)],
                         ids=["rope_chunked_qknorm", "rope_chunked", "nope_temperature"])
def test_attention_equals_a_naive_reference(use_rope, qk_norm):
    """Forward and every gradient held to the naive reference's fp64 (tests/numerics.py)."""
    attn, cos, sin = attention(use_rope, qk_norm=qk_norm)
    x = torch.randn(2, S, D)
    grad_out = torch.randn(2, S, D)
    ours = outputs_and_grads(lambda m, x: m(x, cos, sin), attn, x, grad_out)
    ref32, ref64 = (outputs_and_grads(lambda m, x: naive(m, x, cos.to(dtype), sin.to(dtype), 4, use_rope, qk_norm,
                                                         (4.0, 0.5)), attn.to(dtype), x, grad_out)
                    for dtype in (F32, F64))
    attn.float()
    assert len(ours) == 6  # out, x, four weights
    assert_fp32_only(ours, ref32, ref64)
    ref = ref32["out"]
    if not use_rope:  # the temperature really acts at these positions (floor 4): without it the output differs
        attn.temperature = None
        assert (attn(x, cos, sin) - ref).abs().max() > 1e-3


def test_chunk_boundary_cuts_gradients_exactly_and_nope_layers_see_everything():
    """Chunk 4: output 9 depends on inputs 8..9 only (its chunk, causally); a NoPE layer's output 9
    depends on every input 0..9."""
    attn, cos, sin = attention(True)
    x = torch.randn(1, S, D, requires_grad=True)
    attn(x, cos, sin)[0, 9].sum().backward()
    per_pos = x.grad[0].abs().sum(dim=-1)
    assert torch.all(per_pos[:8] == 0) and torch.all(per_pos[10:] == 0) and torch.all(per_pos[8:10] > 0)
    nope, cos, sin = attention(False)
    x = torch.randn(1, S, D, requires_grad=True)
    nope(x, cos, sin)[0, 9].sum().backward()
    per_pos = x.grad[0].abs().sum(dim=-1)
    assert torch.all(per_pos[:10] > 0) and torch.all(per_pos[10:] == 0)


def test_weightless_qk_norm_is_rms_normalization():
    x = torch.randn(3, 5, 16) * 7
    y = rms_normalize(x, 1e-5)
    # exactly ms / (ms + eps) for ms = mean(x^2); fp32 rounds a 16-term mean of squares in y and again
    # in y^2 (16 u each, u = eps / 2) and the rsqrt and products (a few ulps): within 32 eps of it
    ms = x.double().pow(2).mean(-1)
    torch.testing.assert_close(y.pow(2).mean(-1).double(), ms / (ms + 1e-5), atol=32 * EPS32, rtol=0)


def test_experts_are_gated_on_their_input():
    """score_before_experts: expert(g * x) (Llama 4), not g * expert(x) (the SwiGLU is not linear)."""
    torch.manual_seed(0)
    args = dict(num_experts=4, top_k=1, expert_dim=16, score_func="sigmoid", load_balance_coeff=0.0)
    before, after = MoE(8, MoEArgs(**args, score_before_experts=True)), MoE(8, MoEArgs(**args))
    for m in (before, after):
        m.init_weights(0.3, 0.3)
    after.load_state_dict(before.state_dict())
    x = torch.randn(2, 6, 8)
    with torch.no_grad():
        _, chosen = before.router.choose(before.router.scores(x.view(-1, 8)))

        def reference(dtype):  # written out in dtype (the layer scores and combines in fp32 whatever it)
            tokens = x.view(-1, 8).to(dtype)
            w1, w2, w3 = (w.to(dtype) for w in (before.experts.w1, before.experts.w2, before.experts.w3))
            gates = (tokens @ before.router.gate.weight.to(dtype).T).sigmoid().gather(1, chosen)
            rows = tokens * gates  # top-1: one gate per token
            return {"out": torch.stack([w2[e] @ (torch.nn.functional.silu(w1[e] @ r) * (w3[e] @ r))
                                        for r, e in zip(rows, chosen[:, 0])]).view(2, 6, 8)}

        ref32 = reference(F32)
        assert_fp32_only({"out": before(x)}, ref32, reference(F64))
        assert (after(x) - ref32["out"]).abs().max() > 1e-4


def test_scout_rotary_scaling_equals_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    args = flavor("llama4_scout", "max_seq_len=64")
    cfg = transformers.Llama4TextConfig(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
        "high_freq_factor": 1.0, "original_max_position_embeddings": 8192})
    hf_freqs, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    with torch.device("meta"):
        model = FAMILY.build(args)
    ours = model.rope_frequencies("cpu")
    # ours: the fp64 value rounded once to fp32 (half an ulp); HF's: a pow and a division in fp32
    # (an ulp or two): within 4 ulps (relative 4 eps)
    torch.testing.assert_close(ours, hf_freqs.float(), atol=0, rtol=4 * EPS32)
    plain = inverse_frequencies(128, 500000.0).float()
    # long wavelengths divided by 16: a power of two, so round(f / 16) = round(f) / 16 exactly
    torch.testing.assert_close(ours[-8:], plain[-8:] / 16, atol=0, rtol=0)
    assert torch.equal(ours[:8], plain[:8])  # short ones kept


# ------------------------------------------------------------------------------ family rules


def test_family_rules_refuse_in_one_line():
    args = flavor("llama4_debug")
    cases = [
        (lambda: FAMILY.check(args, ParallelDims(world_size=2, dp_shard=1, cp=2), 256), r"parallelism.cp=2 is not supported for Llama 4"),
        (lambda: FAMILY.check(args, ParallelDims(world_size=2, dp_shard=1, tp=2), 256), r"parallelism.tp=2 is not supported for Mixture-of-Experts"),
        (lambda: flavor("llama4_debug", "rope_scaling=yarn"), r"rope_scaling='yarn' is not one of none, llama3"),
        (lambda: flavor("llama4_debug", "moe_layers=[1,7]"), r"must hold layer ids in \[0, 4\)"),
    ]
    for fn, message in cases:
        with pytest.raises((ConfigError, ValueError), match=message) as err:
            fn()
        assert "\n" not in str(err.value)
    assert args.moe_layer_ids == [1, 3] and args.dense_layer_ids == [0, 2] and args.nope_layer_ids == [3]
    assert FAMILY.signature(args) != FAMILY.signature(flavor("llama4_debug", "attention_chunk_size=32"))
    assert FAMILY.signature(args) != FAMILY.signature(flavor("llama4_debug", "nope_interval=2"))
    # chunked layers attend to at most chunk keys: fewer attention FLOPs than full causal at seq 256
    assert FAMILY.flops_per_token(args, 256) < FAMILY.flops_per_token(flavor("llama4_debug", "attention_chunk_size=null"), 256)


def test_hf_export_refusals_are_one_line():
    cases = [
        (lambda: FAMILY.hf.hf_config(flavor("llama4_debug", "moe.score_func=softmax")), "score_func=softmax"),
        (lambda: FAMILY.hf.hf_config(flavor("llama4_debug", "moe.score_before_experts=false")), "score_before_experts=False"),
        (lambda: FAMILY.hf.args_from_hf_config({"model_type": "llama4", "text_config": {}}), "multimodal Llama 4"),
        (lambda: FAMILY.hf.args_from_hf_config({"model_type": "llama4_text", "attention_bias": True}), "attention_bias=true"),
    ]
    sd = {"layers.1.feed_forward.expert_bias": torch.ones(8)}
    cases.append((lambda: FAMILY.hf.to_hf_state(sd, flavor("llama4_debug")), "load_balance_coeff=0"))
    for fn, message in cases:
        with pytest.raises(HFConversionError, match=message) as err:
            fn()
        assert "\n" not in str(err.value)


def test_dry_run_plans_llama4_scout():
    from titan_hydra.planner.plan import plan
    from titan_hydra.validate import validate

    cfg = compose_cfg(["dry_run=true", "model=llama4_scout", "cluster=slurm_h100", "cluster.nnodes=4",
                       "parallelism=fsdp_ep", "parallelism.ep=8", "training.seq_len=8192",
                       "training.local_batch_size=1", "data.max_documents=1"])
    validate(cfg)
    text = plan(spec_of(cfg)).format()
    assert "107,769,861,120" in text and "17,172,894,720" in text and "ep=8" in text
