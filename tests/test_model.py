"""Unit tests for the decoder families (Llama 2/3, Qwen3): shapes, parameter/FLOP counts,
numerics, rotary, init, PP staging, and what is specific to Qwen3 (QK-norm, decoupled head_dim,
tied embeddings, half-split rotary)."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from helpers import CONF, compose_cfg

from titan_hydra.models.common.rotary import apply_rope, tables_from_frequencies
from titan_hydra.models.llama3 import FAMILY as LLAMA
from titan_hydra.models.llama3 import Llama3, LlamaArgs
from titan_hydra.models.llama3.model import rope_frequencies
from titan_hydra.models.qwen3 import FAMILY as QWEN3
from titan_hydra.models.qwen3 import Qwen3, Qwen3Args
from titan_hydra.models.registry import args_of, build_model

from numerics import assert_fp32_close

EPS32 = torch.finfo(torch.float32).eps

# Language-model flavors (flux_* is an image model: tests/test_flux_training.py counts its parameters).
# the native decoders' flavors (flux: test_flux_model.py; hf*: transformers' own classes, test_hf_family.py)
FLAVORS = sorted(p.stem for p in (CONF / "model").glob("*.yaml") if not p.stem.startswith(("flux", "hf")))
DEBUG_FLAVORS = ["llama3_debug", "qwen3_debug"]

# Exact counts of a meta build (a tied matrix counted once). Published figures match: Llama 3.1
# 8B 8.03B, 70B 70.55B, 405B 405.85B, Llama 2 7B 6.74B; the tied Llama 3.2 releases (1B
# 1,235,814,400; 3B 3,212,749,824); Qwen3 0.6B (0.44B non-embedding), 1.7B (1.4B), 4B (3.6B),
# 8B 8.2B (6.95B), 14B 14.8B (13.2B), 32B 32.8B (31.2B). tests/test_config.py checks each one
# against transformers' own model of the published HF config.
EXPECTED_PARAMS = {
    "llama3_debug": 6_163_712,
    "llama3_100m": 102_258_432,
    "llama3_1b": 1_235_814_400,
    "llama3_3b": 3_212_749_824,
    "llama3_8b": 8_030_261_248,
    "llama3_70b": 70_553_706_496,
    "llama3_405b": 405_853_388_800,
    "llama2_7b": 6_738_415_616,
    "llama2_13b": 13_015_864_320,
    "llama2_70b": 68_976_648_192,
    "qwen3_debug": 6_426_624,
    "qwen3_0.6b": 596_049_920,
    "qwen3_1.7b": 1_720_574_976,
    "qwen3_4b": 4_022_468_096,
    "qwen3_8b": 8_190_735_360,
    "qwen3_14b": 14_768_307_200,
    "qwen3_32b": 32_762_123_264,
    "qwen3_moe_debug": 5_778_176,
    "qwen3_30b_a3b": 30_532_122_624,  # 3,353,032,704 active (tests/test_moe.py)
    "qwen3_235b_a22b": 235_093_634_560,  # 22,190,763,520 active
    "gpt_oss_debug": 8_164_672,  # 3,427,648 active
    "gpt_oss_20b": 20_914_757_184,  # 4,187,440,704 active (tests/test_gpt_oss.py)
    "gpt_oss_120b": 116_829_156_672,  # 5,711,982,912 active
    "deepseek_v3_debug": 7_971_328,  # 4,432,384 active
    "deepseek_v3_16b": 15_706_484_224,  # 2,661,150,208 active (tests/test_deepseek_v3.py)
    "deepseek_v3_236b": 235_741_434_880,  # 21,375,800,320 active
    "deepseek_v3_671b": 671_026_404_352,  # 37,552,282,624 active
    "llama4_debug": 6_166_784,  # 3,414,272 active
    "llama4_scout": 107_769_861_120,  # 17,172,894,720 active (tests/test_llama4.py)
    "llama4_maverick": 400_711_848_960,  # 17,184,691,200 active
    "qwen3_5_debug": 7_906_080,
    "qwen3_5_moe_debug": 5_666_320,  # 3,307,024 active
    "qwen3_5_9b": 8_953_803_264,
    "qwen3_5_35b_a3b": 34_660_610_688,  # 3,454,988,928 active
    "qwen3_next_80b_a3b": 79_674_391_296,  # 3,874,929,408 active
}
EXPECTED_FFN = {"llama3_1b": 8192, "llama3_3b": 8192, "llama3_8b": 14336, "llama3_70b": 28672,
                "llama3_405b": 53248, "llama2_7b": 11008, "llama2_13b": 13824, "llama2_70b": 28672,
                "qwen3_0.6b": 3072, "qwen3_1.7b": 6144, "qwen3_4b": 9728, "qwen3_8b": 12288,
                "qwen3_14b": 17408, "qwen3_32b": 25600}
SEQ = 32
VOCAB = 2048  # both debug flavors
TRUNC3 = math.sqrt(1 - 6 * math.exp(-4.5) / math.sqrt(2 * math.pi) / math.erf(3 / math.sqrt(2)))


def flavor(name: str, *overrides: str):
    """(family, args) of a conf/model option, composed as launch.py does."""
    return args_of(compose_cfg([f"model={name}", *(f"model.{o}" for o in overrides)]).model)


def materialize(family, args):
    """Build on meta, then to_empty + init_weights: the path every rank takes."""
    with torch.device("meta"):
        model = family.build(args)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model


@pytest.fixture(scope="module", params=DEBUG_FLAVORS)
def debug_model(request):
    return materialize(*flavor(request.param)).eval()


def tokens(batch=2, seq=SEQ, vocab=VOCAB, seed=1):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------- counting


@pytest.mark.parametrize("name", FLAVORS)
def test_param_count_matches_meta_build(name):
    cfg = compose_cfg([f"model={name}"])
    family, args = args_of(cfg.model)
    with torch.device("meta"):
        built_family, model = build_model(cfg.model)
    assert built_family is family and model.args == args
    shape = family.shape(args)
    assert sum(p.numel() for p in model.parameters()) == shape.params == EXPECTED_PARAMS[name]
    assert shape.embedding_params == args.vocab_size * args.dim
    assert shape.tied_embeddings == args.tie_word_embeddings
    if name in EXPECTED_FFN:
        assert shape.ffn_dim == args.ffn_hidden_dim == EXPECTED_FFN[name]


@pytest.mark.parametrize("name", DEBUG_FLAVORS)
def test_fqns_and_overrides(name):
    big = "llama3_8b" if name.startswith("llama") else "qwen3_8b"
    cfg = compose_cfg([f"model={big}", "model.max_seq_len=128", "model.n_layers=2"])
    family, args = args_of(cfg.model)
    with torch.device("meta"):
        _, model = build_model(cfg.model)
    names = {n for n, _ in model.named_parameters()}
    expected = ["tok_embeddings.weight", "norm.weight", "output.weight",
                "layers.1.attention.wq.weight", "layers.1.attention.wo.weight",
                "layers.1.feed_forward.w3.weight", "layers.1.attention_norm.weight",
                "layers.1.ffn_norm.weight"]
    if family is QWEN3:
        expected += ["layers.1.attention.q_norm.weight", "layers.1.attention.k_norm.weight"]
    else:
        assert not any("q_norm" in n for n in names)
    assert set(expected) <= names
    assert model.args.dim == 4096 and model.args.n_layers == 2
    assert model.rope_cos.shape == (128, args.head_dim // 2)
    assert "rope_cos" not in model.state_dict()  # non-persistent: not checkpointed
    with torch.device("meta"):
        assert family.build(model.args).args == model.args
    with pytest.raises(TypeError):  # constructors take fields only; flavors live in conf/model
        type(model)(flavor=big)


# ------------------------------------------------------------------------------- numerics


def test_forward_shape_finite_and_backward(debug_model):
    model = copy.deepcopy(debug_model).train()
    logits = model(tokens())
    assert logits.shape == (2, SEQ, VOCAB) and torch.isfinite(logits).all()
    logits.float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_causality(debug_model):
    t, pos = tokens(), 10
    changed = t.clone()
    changed[:, pos] = (changed[:, pos] + 1) % VOCAB
    with torch.no_grad():
        a, b = debug_model(t), debug_model(changed)
    torch.testing.assert_close(a[:, :pos], b[:, :pos], rtol=0, atol=0)
    assert ((a[:, pos:] - b[:, pos:]).abs().amax(-1) > 1e-4).all()


@pytest.mark.parametrize("name,gqa_kv", [("llama3_debug", 4), ("qwen3_debug", 2)])
def test_gqa_matches_mha_with_repeated_kv(name, gqa_kv):
    """GQA equals MHA whose wk/wv rows are each kv head's block repeated n_rep times."""
    family, args = flavor(name)
    h, hd, dim = args.n_heads, args.head_dim, args.dim
    gqa = materialize(family, dataclasses.replace(args, n_kv_heads=gqa_kv)).eval()
    assert gqa.layers["0"].attention.wk.weight.shape == (gqa_kv * hd, dim)
    mha = materialize(family, dataclasses.replace(args, n_kv_heads=h)).eval()
    sd = gqa.state_dict()
    for key, w in list(sd.items()):
        if key.endswith(("attention.wk.weight", "attention.wv.weight")):
            sd[key] = w.view(gqa_kv, hd, dim).repeat_interleave(h // gqa_kv, dim=0).reshape(h * hd, dim)
    mha.load_state_dict(sd)
    with torch.no_grad():
        out = gqa(tokens())
        assert_fp32_close({"logits": out}, {"logits": mha(tokens())})  # whole models: no fp64 form
    assert out.shape == (2, SEQ, VOCAB) and torch.isfinite(out).all()


def test_bf16_autocast_forward(debug_model):
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = debug_model(tokens())
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()
    with torch.no_grad():
        ref = debug_model(tokens())
    # each of the 6 layers rounds its activations to bf16 before its attention and its FFN (2^-8
    # relative each), errors that add up but do not compound on average: 12 bf16 roundings
    assert (logits.float() - ref).abs().mean() < 12 * 2**-8 * ref.abs().mean()


# ------------------------------------------------------------------------------- rotary


def test_rope_matches_complex_interleaved_reference():
    _, args = flavor("llama3_debug", f"max_seq_len={SEQ}")
    cos, sin = tables_from_frequencies(rope_frequencies(args), args.max_seq_len)
    x = torch.randn(2, SEQ, 3, args.head_dim)
    freqs_cis = torch.polar(torch.ones_like(cos), torch.atan2(sin, cos))  # [S, D/2]
    ref = torch.view_as_real(torch.view_as_complex(x.reshape(2, SEQ, 3, -1, 2)) * freqs_cis[None, :, None])
    # the reference re-derives each table entry through atan2 and polar (within 3 eps), and each side
    # rounds two products and a sum (3 eps of |x0| + |x1|): 2 max|x| x 8 eps
    torch.testing.assert_close(apply_rope(x, cos, sin), ref.flatten(-2), rtol=0, atol=16 * EPS32 * x.abs().max().item())
    assert apply_rope(x.bfloat16(), cos, sin).dtype == torch.bfloat16


def test_rope_half_split_matches_hf_rotate_half():
    """Qwen3's pairing is HF's: q*cos + rotate_half(q)*sin with cos/sin repeated over both halves."""
    _, args = flavor("qwen3_debug", f"max_seq_len={SEQ}")
    with torch.device("meta"):
        model = QWEN3.build(args)
    cos, sin = model.rope_tables()
    assert cos.shape == (SEQ, args.head_dim // 2)
    # HF's default inv_freq: 1 / theta^(arange(0, d, 2) / d)
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.int64).float() / args.head_dim))
    angles = torch.outer(torch.arange(SEQ).float(), inv_freq)
    emb = torch.cat((angles, angles), dim=-1)
    hf_cos, hf_sin = emb.cos(), emb.sin()

    def rotate_half(x):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat((-x2, x1), dim=-1)

    x = torch.randn(2, SEQ, 3, args.head_dim)
    ref = x * hf_cos[None, :, None] + rotate_half(x) * hf_sin[None, :, None]
    # HF's fp32 frequencies are within an ulp of ours (the fp64 value rounded once), so the angles
    # within 2 eps of the largest angle (SEQ - 1 radians at frequency 1), cos / sin within an ulp more
    half = args.head_dim // 2
    gap = max((cos - hf_cos[:, :half]).abs().max().item(), (sin - hf_sin[:, :half]).abs().max().item())
    assert gap <= (2 * (SEQ - 1) + 2) * EPS32, gap
    # then the rotations differ by that gap times |x0| + |x1|, plus each side's rounding (3 eps of it)
    bound = 2 * x.abs().max().item() * (gap + 2 * 3 * EPS32)
    torch.testing.assert_close(apply_rope(x, cos, sin, interleaved=False), ref, rtol=0, atol=bound)
    # and the model's attention uses that pairing
    assert all(not blk.attention.rope_interleaved for blk in model.layers.values())
    assert apply_rope(x.bfloat16(), cos, sin, interleaved=False).dtype == torch.bfloat16
    assert not torch.allclose(apply_rope(x, cos, sin, interleaved=True), ref, atol=1e-3)


def test_rope_scaling_only_touches_low_frequencies():
    _, plain_args = flavor("llama3_debug")
    plain = rope_frequencies(plain_args)
    scaled = rope_frequencies(dataclasses.replace(plain_args, rope_scaling=True, rope_scaling_factor=8.0))
    wavelen = 2 * math.pi / plain
    high, low = wavelen < 8192 / 4, wavelen > 8192 / 1
    mid = ~(high | low)
    assert high.any() and low.any() and mid.any()  # the debug head_dim spans all three bands
    # exact: the high band is kept, the low band divided by 8 (a power of two) in fp64 before the one
    # rounding to fp32, and round(f / 8) = round(f) / 8
    torch.testing.assert_close(scaled[high], plain[high], rtol=0, atol=0)
    torch.testing.assert_close(scaled[low], plain[low] / 8, rtol=0, atol=0)
    assert ((scaled[mid] < plain[mid]) & (scaled[mid] > plain[mid] / 8)).all()


# ------------------------------------------------------------------------------- init


def test_init_statistics(debug_model):
    m, args = debug_model, debug_model.args
    tied = args.tie_word_embeddings
    out_std = args.dim ** (-1.0 if tied else -0.5)  # tied: 1/dim keeps the self-logit ~1
    assert m.output.weight.std().item() == pytest.approx(out_std * TRUNC3, rel=0.03)
    assert m.output.weight.abs().max().item() <= 3 * out_std + 1e-6
    if tied:  # one shared matrix
        assert m.tok_embeddings.weight is m.output.weight
    else:
        assert m.tok_embeddings.weight.std().item() == pytest.approx(1.0, rel=0.03)
    assert m.layers["0"].attention.wq.weight.std().item() == pytest.approx(0.02 * TRUNC3, rel=0.03)
    for i in (0, 5):
        layer = m.layers[str(i)]
        std = 0.02 / math.sqrt(2 * (i + 1)) * TRUNC3
        assert layer.attention.wo.weight.std().item() == pytest.approx(std, rel=0.03)
        assert layer.feed_forward.w2.weight.std().item() == pytest.approx(std, rel=0.03)
    assert (m.norm.weight == 1).all() and (m.layers["3"].ffn_norm.weight == 1).all()
    if m.layers["2"].attention.q_norm is not None:
        assert (m.layers["2"].attention.q_norm.weight == 1).all()
        assert (m.layers["2"].attention.k_norm.weight == 1).all()
    cos, sin = m.rope_tables()  # to_empty left garbage; init_weights must rebuild the tables
    assert torch.equal(m.rope_cos, cos) and torch.equal(m.rope_sin, sin)
    family = LLAMA if isinstance(m, Llama3) else QWEN3
    flat = materialize(family, dataclasses.replace(args, depth_init=False))
    assert flat.layers["0"].attention.wo.weight.std().item() == pytest.approx(
        0.02 / math.sqrt(2 * args.n_layers) * TRUNC3, rel=0.03)


# ------------------------------------------------------------------------------- pipeline


def test_pipeline_stages_compose_to_full_model(debug_model):
    family = LLAMA if isinstance(debug_model, Llama3) else QWEN3
    first = family.cut_stage(debug_model, range(0, 3), is_first=True, is_last=False)
    second = family.cut_stage(debug_model, range(3, 6), is_first=False, is_last=True)
    assert first.norm is None and first.output is None and second.tok_embeddings is None
    assert list(second.layers) == ["3", "4", "5"]  # FQNs survive staging
    torch.manual_seed(0)
    second.init_weights()  # a stage with no embeddings/none modules still initializes
    second.load_state_dict({k: v for k, v in debug_model.state_dict().items() if k in second.state_dict()})
    t = tokens()
    with torch.no_grad():
        hidden = first(t)
        assert hidden.shape == (2, SEQ, debug_model.args.dim)
        # the same operations on the same shapes in the same order: bit for bit
        torch.testing.assert_close(second(hidden), debug_model(t), rtol=0, atol=0)


# ------------------------------------------------------------------------------- FLOPs


def test_flops_per_token_debug_by_hand():
    _, args = flavor("llama3_debug")
    # per layer: attention 4*256*256, SwiGLU 3*256*768, two norms 2*256
    per_layer = 4 * 256 * 256 + 3 * 256 * 768 + 2 * 256
    n = 6 * per_layer + 256 + 2048 * 256  # + final norm + output (embedding excluded)
    assert n == 5_639_424
    expected = 6 * n + 12 * 6 * 16 * 16 * 2048
    assert LLAMA.flops_per_token(args, 2048) == expected == 71_585_280
    # the args-based count agrees with the parameters of a built model
    one = dataclasses.replace(args, n_layers=1)
    with torch.device("meta"):
        model = LLAMA.build(one)
    matmul = sum(p.numel() for p in model.parameters()) - model.tok_embeddings.weight.numel()
    assert LLAMA.flops_per_token(one, 128) == 6 * matmul + 12 * 1 * 16 * 16 * 128


def test_flops_per_token_qwen3_debug_by_hand():
    _, args = flavor("qwen3_debug")
    # q is 8 heads x 64 = 512 wide on a 256-wide model; k/v 4 x 64; QK-norm 2 x 64
    attn = 256 * 512 + 2 * 256 * 256 + 512 * 256 + 2 * 64
    per_layer = attn + 3 * 256 * 768 + 2 * 256
    # tied: the one vocab matrix is the output matmul, counted once
    n = 6 * per_layer + 256 + 2048 * 256
    assert n == QWEN3.shape(args).params == 6_426_624
    expected = 6 * n + 12 * 6 * 8 * 64 * 2048  # attention uses n_heads * head_dim, not dim
    assert QWEN3.flops_per_token(args, 2048) == expected == 114_057_216
    untied = dataclasses.replace(args, tie_word_embeddings=False)
    assert QWEN3.shape(untied).params == n + 2048 * 256
    assert QWEN3.flops_per_token(untied, 2048) == expected  # the lookup table is no matmul


# ------------------------------------------------------------------------------- validation


def test_args_validation():
    llama = dict(dim=256, n_layers=2, n_heads=16, vocab_size=128, max_seq_len=64)
    qwen = dict(dim=128, n_layers=2, n_heads=8, head_dim=16, ffn_hidden_dim=96, vocab_size=128, max_seq_len=64)
    with pytest.raises(ValueError):
        LlamaArgs(**llama, n_kv_heads=5)
    with pytest.raises(ValueError, match="n_kv_heads"):
        Qwen3Args(**qwen, n_kv_heads=3)
    with pytest.raises(ValueError, match="head_dim"):
        Qwen3Args(**{**qwen, "head_dim": 63})
    Qwen3Args(**{**qwen, "dim": 100, "n_heads": 3, "head_dim": 32}, n_kv_heads=1)  # head_dim need not divide dim
    with pytest.raises(TypeError, match="max_seq_len"):  # no shape in code: the yaml is its one source
        LlamaArgs(dim=256, n_layers=2, n_heads=16, vocab_size=128)


# ------------------------------------------------------------------------------- Qwen3 specifics


def tiny_qwen3(**over) -> Qwen3:
    fields = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, ffn_hidden_dim=96, vocab_size=128,
                  max_seq_len=32, tie_word_embeddings=False)
    fields.update(over)
    return materialize(QWEN3, Qwen3Args(**fields)).eval()


def test_qwen3_qk_norm_is_applied():
    model = tiny_qwen3()
    t = tokens(vocab=128)
    with torch.no_grad():
        before = model(t)
        for name in ("q_norm", "k_norm"):
            norm = getattr(model.layers["0"].attention, name)
            assert norm is not None and norm.weight.shape == (32,)  # per head, head_dim wide
            saved = norm.weight.clone()
            norm.weight.mul_(torch.linspace(0.5, 2.0, 32))
            assert (model(t) - before).abs().max() > 1e-3, name
            norm.weight.copy_(saved)
        torch.testing.assert_close(model(t), before, rtol=0, atol=0)
    without = tiny_qwen3(qk_norm=False)
    assert without.layers["0"].attention.q_norm is None
    assert QWEN3.shape(without.args).params == QWEN3.shape(model.args).params - 2 * 2 * 32


def test_qwen3_head_dim_decoupled_from_dim():
    model = tiny_qwen3()
    attn = model.layers["0"].attention
    assert attn.wq.weight.shape == (4 * 32, 64) and 4 * 32 != 64
    assert attn.wk.weight.shape == attn.wv.weight.shape == (2 * 32, 64)
    assert attn.wo.weight.shape == (64, 4 * 32)
    assert model.rope_cos.shape == (32, 16)  # tables follow head_dim
    shape = QWEN3.shape(model.args)
    assert (shape.q_dim, shape.kv_dim, shape.head_dim) == (128, 64, 32)
    with torch.no_grad():
        assert model(tokens(vocab=128)).shape == (2, SEQ, 128)


def test_qwen3_tied_embeddings_share_one_parameter():
    model = tiny_qwen3(tie_word_embeddings=True)  # meta build + to_empty + init_weights
    assert model.tok_embeddings.weight is model.output.weight
    params = list(model.parameters())
    assert sum(p.numel() for p in params) == QWEN3.shape(model.args).params
    assert sum(p is model.output.weight for p in params) == 1  # counted once
    assert QWEN3.shape(model.args).params == QWEN3.shape(
        dataclasses.replace(model.args, tie_word_embeddings=False)).params - 128 * 64
    # a step on the shared weight moves both ends
    model.train()
    model(tokens(vocab=128)).float().logsumexp(-1).mean().backward()
    with torch.no_grad():
        model.output.weight.add_(1.0)
    assert torch.equal(model.tok_embeddings.weight, model.output.weight)
    assert model.state_dict()["tok_embeddings.weight"].data_ptr() == model.state_dict()["output.weight"].data_ptr()
