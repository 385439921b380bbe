"""GPT-OSS: counts against transformers, sink / sliding-window attention against a naive reference
(fp32, and bf16 autocast), the window's exact cut-off, YaRN (untruncated) tables, the clamped-SwiGLU
experts and the router, family rules, HF refusals, a dry-run plan.
(Logit parity with GptOssForCausalLM in both directions lives in test_hf_convert.py; training, layout
parity and resume in test_family_training.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from titan_hydra.spec import spec_of
from helpers import compose_cfg
from titan_hydra.errors import ConfigError
from titan_hydra.models.common.attention import Attention
from titan_hydra.models.gpt_oss import FAMILY
from titan_hydra.models.gpt_oss.model import GptOss, GptOssExperts, GptOssRouter, clamped_swiglu
from titan_hydra.models.registry import args_of
from titan_hydra.parallel.parallelism import ParallelDims

from numerics import assert_fp32_only, assert_same_function, outputs_and_grads

F32, F64 = torch.float32, torch.float64
EPS32 = torch.finfo(F32).eps


def flavor(name: str, *overrides: str):
    return args_of(compose_cfg([f"model={name}", *(f"model.{o}" for o in overrides)]).model)[1]


# ------------------------------------------------------------------------------- counting


@pytest.mark.parametrize("name,layers,experts", [("gpt_oss_20b", 24, 32), ("gpt_oss_120b", 36, 128)])
def test_parameter_counts_equal_transformers(name, layers, experts):
    """Total and active parameters equal GptOssForCausalLM's on the meta device (published config)."""
    transformers = pytest.importorskip("transformers")
    args = flavor(name)
    shape = FAMILY.shape(args)
    with torch.device("meta"):  # GptOssConfig's defaults are gpt-oss-120b's; layers/experts differ for 20b
        hf = transformers.GptOssForCausalLM(transformers.GptOssConfig(num_hidden_layers=layers,
                                                                      num_local_experts=experts))
    total = sum(p.numel() for p in hf.parameters())
    routed = sum(p.numel() for n, p in hf.named_parameters() if ".mlp.experts." in n)
    active = total - routed * (experts - hf.config.num_experts_per_tok) // experts
    assert (shape.params, shape.active_params) == (total, active)
    assert (shape.n_experts, shape.top_k, shape.moe_layers) == (experts, 4, layers)
    expected = {"gpt_oss_20b": (20_914_757_184, 4_187_440_704), "gpt_oss_120b": (116_829_156_672, 5_711_982_912)}
    assert (shape.params, shape.active_params) == expected[name]


# ------------------------------------------------------------------------------ attention

D, HEADS, KV, HD, S = 32, 4, 2, 8, 12


def rotate_half(x, cos, sin):
    a, b = x.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]  # [S, 1, HD/2] against x [B, S, H, HD/2]
    return torch.cat((a * c - b * s, b * c + a * s), dim=-1)


def naive_attention(attn: Attention, x, cos, sin, window):
    """Attention written out: projections with biases, rotary, repeated kv heads, masked scores,
    the sink logit appended to every row, softmax, sink column dropped. Plain operations in x's
    dtype, so it has an fp64 form (the layer's rotary computes in fp32 whatever the dtype)."""
    b, s, _ = x.shape
    q = (x @ attn.wq.weight.T + attn.wq.bias).view(b, s, -1, HD)
    k = (x @ attn.wk.weight.T + attn.wk.bias).view(b, s, -1, HD)
    v = (x @ attn.wv.weight.T + attn.wv.bias).view(b, s, -1, HD)
    q, k = rotate_half(q, cos, sin), rotate_half(k, cos, sin)
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(HD)
    i = torch.arange(s)
    visible = (i[:, None] >= i[None, :]) & ((i[:, None] - i[None, :] < window) if window else True)
    scores = scores.masked_fill(~visible, float("-inf"))
    scores = torch.cat([scores, attn.sinks.view(1, -1, 1, 1).expand(b, -1, s, 1)], dim=-1)
    probs = scores.softmax(dim=-1)[..., :-1]
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, -1)
    return out @ attn.wo.weight.T + attn.wo.bias


def sink_attention(window):
    torch.manual_seed(0)
    attn = Attention(D, HEADS, KV, HD, rope_interleaved=False, bias=True, out_bias=True, sliding_window=window,
                     sinks=True)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.3)
    angles = torch.outer(torch.arange(S, dtype=torch.float32), 1.0 / 100 ** (torch.arange(0, HD, 2) / HD))
    return attn, angles.cos(), angles.sin()


@pytest.mark.parametrize("window", [None, 4])
def test_sink_and_window_attention_equal_a_naive_reference(window):
    """fp32 forward and every gradient (input, weights, biases, sinks) held to the naive reference's
    fp64 (the layer has no fp64 form: its rotary computes in fp32): tests/numerics.py."""
    attn, cos, sin = sink_attention(window)
    x = torch.randn(2, S, D)
    grad_out = torch.randn(2, S, D)
    ours = outputs_and_grads(lambda m, x: m(x, cos, sin), attn, x, grad_out)
    ref32, ref64 = (outputs_and_grads(lambda m, x: naive_attention(m, x, cos.to(dtype), sin.to(dtype), window),
                                      attn.to(dtype), x, grad_out) for dtype in (F32, F64))
    attn.float()
    assert len(ours) == 11  # out, x, four weights and biases, sinks
    assert_fp32_only(ours, ref32, ref64)
    assert ref32["sinks"].abs().min() > 0  # the sinks learn
    ref = ref32["out"]
    # a sink takes probability mass: without it the output differs
    with torch.no_grad():
        attn.sinks.fill_(-1e4)
        assert (attn(x, cos, sin) - ref).abs().max() > 1e-3


@pytest.mark.parametrize("sdpa_dtype", [None, torch.float32])
def test_sink_and_window_attention_under_bf16_autocast_track_fp32(sdpa_dtype):
    """bf16 autocast (attention in bf16, or upcast by the precision policy): forward and the sinks'
    gradient within bf16 rounding of the fp32 reference."""
    attn, cos, sin = sink_attention(4)
    attn.sdpa_dtype = sdpa_dtype
    x = torch.randn(2, S, D)
    grad_out = torch.randn(2, S, D)
    ref = naive_attention(attn, x, cos, sin, 4)
    (ref_sinks,) = torch.autograd.grad((ref * grad_out).sum(), [attn.sinks])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attn(x, cos, sin)
    (sinks,) = torch.autograd.grad((out.float() * grad_out).sum(), [attn.sinks])
    assert out.dtype == torch.bfloat16
    # bf16 rounds x and the weights, the projections, the rotated q/k, the scores and the output
    # (2^-8 relative each, through gains of O(1)): five bf16 roundings of the largest value
    assert (out.float() - ref).abs().max() <= 5 * 2**-8 * ref.abs().max()
    # the sinks' gradient: twice that (the backward rounds the output's and the probabilities' gradients too)
    assert (sinks - ref_sinks).abs().max() <= 2 * 5 * 2**-8 * ref_sinks.abs().max()


def test_a_token_beyond_the_window_has_exactly_zero_gradient():
    """Window 4: output 9 depends on inputs 6..9 only (gradient exactly 0 elsewhere); in a model of
    two all-sliding layers the receptive field is 2 x (4 - 1) + 1 positions."""
    attn, cos, sin = sink_attention(4)
    x = torch.randn(1, S, D, requires_grad=True)
    attn(x, cos, sin)[0, 9].sum().backward()
    per_pos = x.grad[0].abs().sum(dim=-1)
    assert torch.all(per_pos[:6] == 0) and torch.all(per_pos[10:] == 0)
    assert torch.all(per_pos[6:10] > 0)

    torch.manual_seed(0)
    model = GptOss(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, vocab_size=64, max_seq_len=32,
                   sliding_window=4, layer_types=["sliding_attention"] * 2,
                   moe=dict(num_experts=4, top_k=2, expert_dim=16, route_norm=True, load_balance_coeff=0.0))
    model.init_weights()
    emb, model.tok_embeddings = model.tok_embeddings, None  # feed embeddings that carry a gradient
    h = emb(torch.randint(0, 64, (1, 16))).detach().requires_grad_()
    model(h)[0, 12].sum().backward()
    reach = h.grad[0].abs().sum(dim=-1)
    assert torch.all(reach[:6] == 0) and torch.all(reach[6:13] > 0) and torch.all(reach[13:] == 0)


def test_default_attention_path_is_unchanged():
    """No window and no sinks: the plain is_causal SDPA call, bit for bit."""
    torch.manual_seed(0)
    attn = Attention(D, HEADS, KV, HD)
    q, k, v = (torch.randn(2, HEADS, S, HD) for _ in range(3))
    assert attn.sinks is None and attn.wo.bias is None
    assert torch.equal(attn._sdpa(q, k, v), torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))


# -------------------------------------------------------------------------- rotary, experts


def test_yarn_tables_equal_transformers():
    """gpt-oss's YaRN (factor 32 over 4096, truncate false, magnitude 1 + 0.1 ln 32) equals HF's tables."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    args = flavor("gpt_oss_20b", "max_seq_len=4096")
    with torch.device("meta"):
        model = FAMILY.build(args)
    cos, sin = model.rope_tables("cpu")
    rope = GptOssRotaryEmbedding(transformers.GptOssConfig(max_position_embeddings=4096))
    hf_cos, hf_sin = rope(torch.zeros(1, dtype=torch.float32), torch.arange(4096)[None])
    assert rope.attention_scaling == pytest.approx(1 + 0.1 * math.log(32))
    # the same fp32 angles (positions x the same fp32 frequencies) through cos / sin (each within
    # an ulp, vectorized or not) and one product by the magnitude (<= 1.35): four ulps of it
    bound = 4 * EPS32 * rope.attention_scaling
    assert (cos - hf_cos[0]).abs().max() <= bound and (sin - hf_sin[0]).abs().max() <= bound
    # truncation would move the ramp (HF's default for other models): the tables differ
    truncated, _ = FAMILY.build(flavor("gpt_oss_debug", "rope_truncate=true", "head_dim=64")).rope_tables("cpu")
    untruncated, _ = FAMILY.build(flavor("gpt_oss_debug", "head_dim=64")).rope_tables("cpu")
    assert (truncated - untruncated).abs().max() > 1e-3


def test_experts_clamped_swiglu_grouped_equals_loop_equals_hf():
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as HFExperts

    torch.manual_seed(0)
    e, dim, hidden, limit = 4, 16, 12, 0.5  # a small limit so both clamps bite
    ours = GptOssExperts(dim, hidden, e, use_grouped_mm=True, limit=limit)
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0, 0.5)
    loop = GptOssExperts(dim, hidden, e, use_grouped_mm=False, limit=limit)
    loop.load_state_dict(ours.state_dict())
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(int(counts.sum()), dim)
    # grouped_mm has no fp64 form on CPU: held to the loop's fp64
    assert_fp32_only({"out": ours(x, counts)}, {"out": loop(x, counts)}, {"out": loop.double()(x.double(), counts)})
    loop.float()
    hf = HFExperts(transformers.GptOssConfig(hidden_size=dim, intermediate_size=hidden, num_local_experts=e,
                                             swiglu_limit=limit))
    with torch.no_grad():
        # HF: [E, dim, 2 x hidden], gate and up interleaved on the last dim
        hf.gate_up_proj.copy_(torch.stack((ours.w1.transpose(1, 2), ours.w3.transpose(1, 2)), dim=-1).flatten(-2))
        hf.gate_up_proj_bias.copy_(torch.stack((ours.w1_bias, ours.w3_bias), dim=-1).flatten(-2))
        hf.down_proj.copy_(ours.w2.transpose(1, 2))
        hf.down_proj_bias.copy_(ours.w2_bias)
    expert_of_row = torch.repeat_interleave(torch.arange(e), counts)

    def compute(dtype):  # both have fp64 forms (ours: the loop; HF's experts cast nothing)
        return ({"out": loop.to(dtype)(x.to(dtype), counts)},
                {"out": hf.to(dtype)(x.to(dtype), expert_of_row[:, None], torch.ones(x.shape[0], 1, dtype=dtype))})

    assert_same_function(compute)
    assert_fp32_only({"out": ours(x, counts)}, compute(F32)[1], compute(F64)[1])  # and the grouped kernel
    gate, up = torch.tensor([-3.0, 0.2, 9.0]), torch.tensor([-9.0, 0.3, 9.0])
    g = gate.clamp(max=7)
    expected = (up.clamp(-7, 7) + 1) * (g * torch.sigmoid(1.702 * g))
    # the same elementwise operations (a sigmoid within an ulp or two, three products and a sum)
    # maybe fused or reordered: a few roundings, 8 ulps bound them
    assert torch.allclose(clamped_swiglu(gate, up, 1.702, 7.0), expected, rtol=8 * EPS32, atol=0)


def test_router_is_softmax_over_the_top_k_biased_logits():
    from titan_hydra.models.common.moe import MoEArgs

    torch.manual_seed(0)
    router = GptOssRouter(16, MoEArgs(num_experts=6, top_k=3, expert_dim=8, route_norm=True))
    with torch.no_grad():
        router.gate.weight.normal_()
        router.gate.bias.normal_()
    x = torch.randn(5, 16)
    gates, selected, _ = router(x)
    logits = x @ router.gate.weight.T + router.gate.bias
    top, idx = logits.topk(3, dim=-1)
    assert torch.equal(selected, idx)
    # the router scores in fp32 whatever the dtype: held to the written-out softmax's fp64
    logits64 = x.double() @ router.gate.weight.double().T + router.gate.bias.double()
    assert_fp32_only({"gates": gates}, {"gates": top.softmax(dim=-1)},
                     {"gates": logits64.gather(1, idx).softmax(dim=-1)})


# ------------------------------------------------------------------------------- family


def test_family_rules_and_signature():
    args = flavor("gpt_oss_debug")
    with pytest.raises(ConfigError, match="parallelism.cp=2 is not supported for GPT-OSS") as err:
        FAMILY.check(args, ParallelDims(world_size=2, dp_shard=1, cp=2), 128)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="parallelism.tp=2"):
        FAMILY.check(args, ParallelDims(world_size=2, dp_shard=1, tp=2), 128)
    FAMILY.check(args, ParallelDims(world_size=2, dp_shard=2), 128)
    assert FAMILY.signature(args)["sliding_window"] == 64
    assert FAMILY.signature(args)["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert FAMILY.signature(args) != FAMILY.signature(flavor("gpt_oss_debug", "sliding_window=32"))
    # sliding layers attend to at most 64 keys: fewer attention FLOPs than all-full layers
    full = flavor("gpt_oss_debug", "layer_types=[full_attention,full_attention,full_attention,full_attention]")
    s = FAMILY.shape(args)
    assert FAMILY.flops_per_token(full, 1024) - FAMILY.flops_per_token(args, 1024) == 12 * s.n_heads * s.head_dim * (
        2 * (1024 - 64))
    with pytest.raises(ConfigError, match="model.layer_types must list 4 entries"):
        flavor("gpt_oss_debug", "layer_types=[full_attention]")


def test_hf_refusals_are_one_line():
    """What HF's GptOssForCausalLM cannot express is refused, not exported with other behaviour."""
    from titan_hydra.models.common.hf_decoder import HFConversionError

    moe = dict(num_experts=4, top_k=2, expert_dim=16, route_norm=True, load_balance_coeff=0.0)
    model = GptOss(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8, vocab_size=64, max_seq_len=32,
                   sliding_window=8, moe=moe)
    model.init_weights()
    sd = model.state_dict()
    assert set(FAMILY.hf.from_hf_state(FAMILY.hf.to_hf_state(sd, model.args), model.args)) == set(sd)
    sd["layers.0.feed_forward.expert_bias"] = torch.tensor([0.1, -0.1, 0.0, 0.0])
    cases = [
        (lambda: FAMILY.hf.to_hf_state(sd, model.args), "export needs load_balance_coeff=0"),
        (lambda: FAMILY.hf.hf_config(flavor("gpt_oss_debug", "moe.score_func=sigmoid")), "score_func=sigmoid"),
        (lambda: FAMILY.hf.args_from_hf_config({**FAMILY.hf.hf_config(model.args),
                                                "quantization_config": {"quant_method": "mxfp4"}}),
         "quantization_config"),
    ]
    for fn, message in cases:
        with pytest.raises(HFConversionError, match=message) as err:
            fn()
        assert "\n" not in str(err.value)


def test_dry_run_plans_gpt_oss_120b():
    from titan_hydra.planner.plan import plan
    from titan_hydra.validate import validate

    cfg = compose_cfg(["dry_run=true", "model=gpt_oss_120b", "cluster=slurm_h100", "parallelism=fsdp_ep",
                       "training.seq_len=4096", "training.local_batch_size=1", "data.max_documents=1"])
    validate(cfg)
    text = plan(spec_of(cfg)).format()
    assert "116,829,156,672" in text and "5,711,982,912" in text and "ep=2" in text
