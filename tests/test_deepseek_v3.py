"""DeepSeek-V3 family: flavor sizes against transformers, YaRN tables and softmax scale against
transformers, multi-head latent attention against a from-scratch reference, HF tensor-name edge
cases, the family's one-line refusals, and a short training run that learns and logs MoE load.
(Logit parity with DeepseekV3ForCausalLM in both directions lives in test_hf_convert.py.)"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from titan_hydra.spec import spec_of
from helpers import compose_cfg, read_metrics, series

from titan_hydra.errors import ConfigError
from titan_hydra.models.common.hf_decoder import HFConversionError
from titan_hydra.models.deepseek_v3 import FAMILY, DeepSeekV3
from titan_hydra.models.deepseek_v3.model import rope_frequencies
from titan_hydra.models.registry import args_of

from numerics import assert_fp32_only

transformers = pytest.importorskip("transformers")

# Published config.json values (deepseek-ai/DeepSeek-V2-Lite, DeepSeek-V2, DeepSeek-V3) in
# transformers' DeepseekV3Config names; routing fields do not change the counts.
PUBLISHED = {
    "deepseek_v3_16b": dict(vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
                            num_hidden_layers=27, num_attention_heads=16, n_shared_experts=2, n_routed_experts=64,
                            q_lora_rank=None, num_experts_per_tok=6, first_k_dense_replace=1, n_group=1, topk_group=1),
    "deepseek_v3_236b": dict(vocab_size=102400, hidden_size=5120, intermediate_size=12288, moe_intermediate_size=1536,
                             num_hidden_layers=60, num_attention_heads=128, n_shared_experts=2, n_routed_experts=160,
                             q_lora_rank=1536, num_experts_per_tok=6, first_k_dense_replace=1, n_group=8, topk_group=3),
    "deepseek_v3_671b": dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                             num_hidden_layers=61, num_attention_heads=128, n_shared_experts=1, n_routed_experts=256,
                             q_lora_rank=1536, num_experts_per_tok=8, first_k_dense_replace=3, n_group=8, topk_group=4),
}
MLA_SHAPE = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
# (total, active) as counted; DeepSeek quotes 15.7B/2.4B, 236B/21B, 671B/37B (active without embeddings).
COUNTS = {"deepseek_v3_16b": (15_706_484_224, 2_661_150_208),
          "deepseek_v3_236b": (235_741_434_880, 21_375_800_320),
          "deepseek_v3_671b": (671_026_404_352, 37_552_282_624)}


def flavor(name: str, *overrides: str):
    return args_of(compose_cfg([f"model={name}", *(f"model.{o}" for o in overrides)]).model)[1]


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_flavor_counts_equal_transformers(name):
    args = flavor(name)
    shape = FAMILY.shape(args)
    pub = PUBLISHED[name]
    with torch.device("meta"):
        hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**pub, **MLA_SHAPE))
    total = sum(p.numel() for p in hf.parameters())
    experts = sum(p.numel() for n, p in hf.named_parameters() if ".mlp.experts." in n)
    active = total - experts + experts * pub["num_experts_per_tok"] // pub["n_routed_experts"]
    assert (shape.params, shape.active_params) == (total, active) == COUNTS[name]
    assert shape.expert_params == experts
    assert (shape.n_experts, shape.top_k, shape.moe_layers) == (
        pub["n_routed_experts"], pub["num_experts_per_tok"], pub["num_hidden_layers"] - pub["first_k_dense_replace"])


YARN_CASES = [  # factor, original context, mscale, mscale_all_dim, rotary dim, theta
    (40.0, 4096, 1.0, 1.0, 64, 10000.0),  # DeepSeek-V3
    (40.0, 4096, 0.707, 0.707, 64, 10000.0),  # DeepSeek-V2 / V2-Lite
    (4.0, 64, 0.8, 0.6, 16, 10000.0),  # cos/sin multiplier != 1
    (8.0, 100, 1.0, 0.0, 32, 50000.0),  # no mscale_all_dim: multiplier mscale(factor), plain softmax scale
]


@pytest.mark.parametrize("factor, original, mscale, mscale_all_dim, rope_dim, theta", YARN_CASES)
def test_yarn_tables_and_softmax_scale_equal_transformers(factor, original, mscale, mscale_all_dim, rope_dim, theta):
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_mod

    seq = int(factor * original)  # the extended context (transformers warns on any other length)
    rope = dict(rope_type="yarn", rope_theta=theta, factor=factor, original_max_position_embeddings=original,
                beta_fast=32, beta_slow=1, mscale=mscale, mscale_all_dim=mscale_all_dim)
    cfg = transformers.DeepseekV3Config(hidden_size=64, num_attention_heads=2, num_key_value_heads=2,
                                        qk_rope_head_dim=rope_dim,
                                        qk_nope_head_dim=32, v_head_dim=16, kv_lora_rank=16, q_lora_rank=None,
                                        max_position_embeddings=seq, rope_parameters=rope)
    hf_rope = hf_mod.DeepseekV3RotaryEmbedding(cfg)
    cos, sin = hf_rope(torch.zeros(1, dtype=torch.float32), torch.arange(seq)[None])
    with torch.device("meta"):
        scaling = hf_mod.DeepseekV3Attention(cfg, layer_idx=0).scaling
    args = FAMILY.hf.args_from_hf_config(cfg.to_dict() | {"n_routed_experts": 4, "num_experts_per_tok": 2,
                                                          "n_group": 1, "topk_group": 1})
    ours = DeepSeekV3(**{**FAMILY.args_fields(args), "n_layers": 1, "n_dense_layers": 1, "vocab_size": 8})
    half = rope_dim // 2  # HF's tables repeat each pair's angle: cat(freqs, freqs)
    assert torch.equal(ours.rope_cos, cos[0, :, :half]) and torch.equal(ours.rope_sin, sin[0, :, :half])
    assert ours.layers["0"].attention.softmax_scale == scaling
    assert (hf_rope.attention_scaling != 1.0) == (mscale != mscale_all_dim)


def yarn_mscale_by_hand(factor: float, mscale: float) -> float:
    return 0.1 * mscale * math.log(factor) + 1


def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


def naive_mla(attn, x: torch.Tensor, freqs: torch.Tensor, multiplier: float, scale: float) -> torch.Tensor:
    """MLA written out: complex-number rotary on interleaved pairs, explicit masked softmax per head.
    Plain operations in x's dtype, so it has an fp64 form (the layer's norms and rotary are fp32)."""
    b, s, _ = x.shape
    nope, rope, vd, r = attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim, attn.kv_lora_rank
    if attn.q_lora_rank:
        q = rms(x @ attn.wq_a.weight.T, attn.q_norm.weight) @ attn.wq_b.weight.T
    else:
        q = x @ attn.wq.weight.T
    q = q.view(b, s, -1, nope + rope)
    h = q.shape[2]
    kv_a = x @ attn.wkv_a.weight.T
    kv = (rms(kv_a[..., :r], attn.kv_norm.weight) @ attn.wkv_b.weight.T).view(b, s, h, nope + vd)
    turn = torch.polar(torch.full((s, rope // 2), multiplier, dtype=x.dtype),
                       torch.arange(s, dtype=x.dtype)[:, None] * freqs.to(x.dtype)[None, :])

    def rotate(t):  # t [..., s, rope] with s at dim 1
        z = torch.view_as_complex(t.reshape(*t.shape[:-1], rope // 2, 2).contiguous())
        z = z * (turn[None, :, None, :] if t.dim() == 4 else turn[None])
        return torch.view_as_real(z).flatten(-2)

    q_full = torch.cat([q[..., :nope], rotate(q[..., nope:])], dim=-1)
    k_rope = rotate(kv_a[..., r:])  # [b, s, rope]: one rotated key slice shared by every head
    out = torch.zeros(b, s, h, vd, dtype=x.dtype)
    for head in range(h):
        k = torch.cat([kv[:, :, head, :nope], k_rope], dim=-1)
        logits = torch.einsum("bid,bjd->bij", q_full[:, :, head], k) * scale
        logits = logits.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        out[:, :, head] = torch.einsum("bij,bjd->bid", logits.softmax(-1), kv[:, :, head, nope:])
    return out.reshape(b, s, h * vd) @ attn.wo.weight.T


@pytest.mark.parametrize("q_lora_rank", [0, 24])
def test_mla_matches_a_naive_reference(q_lora_rank):
    torch.manual_seed(0)
    mscale, mscale_all_dim, factor = 0.8, 0.6, 4.0
    model = DeepSeekV3(dim=64, n_layers=1, n_heads=4, vocab_size=32, max_seq_len=32, q_lora_rank=q_lora_rank,
                       kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_dense_layers=1,
                       ffn_hidden_dim=32, rope_factor=factor, rope_original_max_seq_len=8, mscale=mscale,
                       mscale_all_dim=mscale_all_dim, moe=dict(num_experts=4, top_k=2, expert_dim=16))
    model.init_weights()
    attn = model.layers["0"].attention
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 1 else 0.2) + (1 if p.dim() == 1 else 0))
    x = torch.randn(2, 16, 64)
    scale = (16 + 8) ** -0.5 * yarn_mscale_by_hand(factor, mscale_all_dim) ** 2
    multiplier = yarn_mscale_by_hand(factor, mscale) / yarn_mscale_by_hand(factor, mscale_all_dim)
    freqs = rope_frequencies(model.args)[0]
    with torch.no_grad():
        got = attn(x, model.rope_cos, model.rope_sin)  # v (12) narrower than q/k (24): the padded path
        ref32, ref64 = ({"out": naive_mla(attn.to(dtype), x.to(dtype), freqs, multiplier, scale)}
                        for dtype in (torch.float32, torch.float64))
        attn.float()
    assert_fp32_only({"out": got}, ref32, ref64)  # the layer has no fp64 form: held to the reference's
    assert (attn.head_dim, attn.sdpa_dtype) == (24, None)


def test_hf_state_reads_fused_experts_and_skips_mtp_layers():
    """transformers' in-memory state dict fuses experts (gate_up_proj); files hold one tensor per
    expert. Both read to the same tensors; a multi-token-prediction layer is skipped."""
    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                        n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                                        first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=None,
                                        qk_rope_head_dim=4, qk_nope_head_dim=8,
                                        v_head_dim=8, max_position_embeddings=32)
    fused = transformers.DeepseekV3ForCausalLM(cfg).state_dict()
    args = FAMILY.hf.args_from_hf_config({**cfg.to_dict(), "num_nextn_predict_layers": 0})  # a model without MTP
    ours = FAMILY.hf.from_hf_state({**fused, "model.layers.2.eh_proj.weight": torch.zeros(1)}, args)
    files = FAMILY.hf.to_hf_state(ours, args)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in files and not any("gate_up" in k for k in files)
    again = FAMILY.hf.from_hf_state(files, args)
    assert again.keys() == ours.keys() and all(torch.equal(again[k], ours[k]) for k in ours)
    gate, up = fused["model.layers.1.mlp.experts.gate_up_proj"][2].chunk(2, dim=0)
    assert torch.equal(ours["layers.1.feed_forward.experts.w1"][2], gate)
    assert torch.equal(ours["layers.1.feed_forward.experts.w3"][2], up)
    with torch.device("meta"):
        model = FAMILY.build(args)
    assert set(ours) == set(model.state_dict())


def test_refusals_are_one_line():
    args = flavor("deepseek_v3_debug")
    with pytest.raises(ConfigError, match="parallelism.tp=1") as err:
        FAMILY.check(args, SimpleNamespace(tp=2, pp=1), 128)
    assert "\n" not in str(err.value)
    with pytest.raises(HFConversionError, match="score_func='softmax'") as err:
        FAMILY.hf.hf_config(flavor("deepseek_v3_16b"))
    assert "\n" not in str(err.value)
    cfg = FAMILY.hf.hf_config(args) | {"quantization_config": {"quant_method": "fp8"}}
    with pytest.raises(HFConversionError, match=r"quantization_config \(fp8\); dequantize"):
        FAMILY.hf.args_from_hf_config(cfg)


def test_debug_flavor_trains_and_logs_expert_load(tmp_path):
    from titan_hydra.train.pretrain import run

    steps = 20
    cfg = compose_cfg(["model=deepseek_v3_debug", "logger=minimal", "training.val_freq=0",
                       "cluster.threads_per_proc=1", f"training.steps={steps}", "training.seq_len=128",
                       "training.local_batch_size=4", "data.max_documents=200"])
    losses = run(spec_of(cfg), str(tmp_path / "run"))["losses"]
    # measured: 8.12 8.19 8.22 8.07 ... 7.20 7.00 7.12 (first 3 mean 8.18, last 3 7.10)
    assert len(losses) == steps and all(math.isfinite(x) for x in losses), losses
    assert math.log(2048) - 0.2 < losses[0] < math.log(2048) + 1.0, losses[0]
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 0.7, (first, last)
    rows = read_metrics(tmp_path / "run")
    # layer 0 is dense; layers 1-3 are MoE, each logging its load every step
    layer_keys = {k for k in rows[-1] if k.startswith("moe/layer")}
    assert layer_keys == {f"moe/layer{i}/max_over_mean" for i in (1, 2, 3)}
    worst = series(rows, "moe/max_over_mean")
    assert len(worst) == steps and all(1.0 <= v <= 8.0 for v in worst), worst
    assert all(0.0 <= v < 1.0 for v in series(rows, "moe/idle_frac"))
