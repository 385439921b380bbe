"""Unit tests for the Llama model: shapes, parameter/FLOP counts, numerics, PP staging."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from titan_hydra.models.flavors import FLAVORS, flavor_args
from titan_hydra.models.llama3 import (
    LlamaArgs,
    Llama3,
    apply_rope,
    build_from_args,
    flops_per_token,
    model_flops_per_token,
    num_params,
    rope_frequencies,
    rope_tables,
)

# Untied counts (output matrix separate from the embedding), verified against a meta build.
# Published figures match: 8B 8.03B, 70B 70.55B, 405B 405.85B, Llama 2 7B 6.74B, and the
# tied 3.2 releases (1B 1,235,814,400; 3B 3,212,749,824) equal these minus vocab*dim.
EXPECTED_PARAMS = {
    "llama3_debug": 6_163_712,
    "llama3_1b": 1_498_482_688,
    "llama3_3b": 3_606_752_256,
    "llama3_8b": 8_030_261_248,
    "llama3_70b": 70_553_706_496,
    "llama3_405b": 405_853_388_800,
    "llama2_7b": 6_738_415_616,
    "llama2_13b": 13_015_864_320,
    "llama2_70b": 68_976_648_192,
}
EXPECTED_FFN = {"llama3_1b": 8192, "llama3_3b": 8192, "llama3_8b": 14336, "llama3_70b": 28672,
                "llama3_405b": 53248, "llama2_7b": 11008, "llama2_13b": 13824, "llama2_70b": 28672}
SEQ = 32


def materialize(**fields) -> Llama3:
    """Build on meta, then to_empty + init_weights: the path every rank takes."""
    with torch.device("meta"):
        model = Llama3(**fields)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model


@pytest.fixture(scope="module")
def debug_model() -> Llama3:
    return materialize(flavor="llama3_debug").eval()


def tokens(batch=2, seq=SEQ, vocab=2048, seed=1):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", sorted(FLAVORS))
def test_param_count_matches_meta_build(name):
    args = flavor_args(name)
    with torch.device("meta"):
        model = Llama3(flavor=name)
    assert model.args == args and model.flavor == name
    assert sum(p.numel() for p in model.parameters()) == num_params(args) == EXPECTED_PARAMS[name]
    assert num_params(args, exclude_embedding=True) == num_params(args) - args.vocab_size * args.dim
    if name in EXPECTED_FFN:
        assert args.ffn_hidden_dim == EXPECTED_FFN[name]


def test_fqns_and_overrides():
    with torch.device("meta"):
        model = Llama3(flavor="llama3_8b", max_seq_len=128, n_layers=2)
    names = {n for n, _ in model.named_parameters()}
    for fqn in ["tok_embeddings.weight", "norm.weight", "output.weight",
                "layers.1.attention.wq.weight", "layers.1.attention.wo.weight",
                "layers.1.feed_forward.w3.weight", "layers.1.attention_norm.weight",
                "layers.1.ffn_norm.weight"]:
        assert fqn in names
    assert model.args.dim == 4096 and model.args.n_layers == 2 and model.rope_cos.shape == (128, 64)
    assert "rope_cos" not in model.state_dict()  # non-persistent: not checkpointed
    with torch.device("meta"):
        assert build_from_args(model.args).args == model.args
    with pytest.raises(KeyError):
        Llama3(flavor="llama9_1t")


def test_forward_shape_finite_and_backward(debug_model):
    model = copy.deepcopy(debug_model).train()
    logits = model(tokens())
    assert logits.shape == (2, SEQ, 2048) and torch.isfinite(logits).all()
    logits.float().logsumexp(-1).mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_causality(debug_model):
    t, pos = tokens(), 10
    changed = t.clone()
    changed[:, pos] = (changed[:, pos] + 1) % 2048
    with torch.no_grad():
        a, b = debug_model(t), debug_model(changed)
    torch.testing.assert_close(a[:, :pos], b[:, :pos], rtol=0, atol=0)
    assert ((a[:, pos:] - b[:, pos:]).abs().amax(-1) > 1e-4).all()


def test_gqa_matches_mha_with_repeated_kv():
    """GQA equals MHA whose wk/wv rows are each kv head's block repeated n_rep times."""
    gqa = materialize(flavor="llama3_debug", n_kv_heads=4).eval()
    assert gqa.layers["0"].attention.wk.weight.shape == (4 * 16, 256)
    mha = materialize(flavor="llama3_debug").eval()
    sd = gqa.state_dict()
    for key, w in list(sd.items()):
        if key.endswith(("attention.wk.weight", "attention.wv.weight")):
            sd[key] = w.view(4, 16, 256).repeat_interleave(4, dim=0).reshape(256, 256)
    mha.load_state_dict(sd)
    with torch.no_grad():
        out = gqa(tokens())
        torch.testing.assert_close(out, mha(tokens()), rtol=1e-5, atol=1e-5)
    assert out.shape == (2, SEQ, 2048) and torch.isfinite(out).all()


def test_rope_matches_complex_interleaved_reference():
    args = flavor_args("llama3_debug", max_seq_len=SEQ)
    cos, sin = rope_tables(args)
    x = torch.randn(2, SEQ, 3, args.head_dim)
    freqs_cis = torch.polar(torch.ones_like(cos), torch.atan2(sin, cos))  # [S, D/2]
    ref = torch.view_as_real(torch.view_as_complex(x.reshape(2, SEQ, 3, -1, 2)) * freqs_cis[None, :, None])
    torch.testing.assert_close(apply_rope(x, cos, sin), ref.flatten(-2), rtol=1e-5, atol=1e-5)
    assert apply_rope(x.bfloat16(), cos, sin).dtype == torch.bfloat16


def test_rope_scaling_only_touches_low_frequencies():
    plain = rope_frequencies(flavor_args("llama3_debug"))
    scaled = rope_frequencies(flavor_args("llama3_debug", rope_scaling=True, rope_scaling_factor=8.0))
    wavelen = 2 * math.pi / plain
    high, low = wavelen < 8192 / 4, wavelen > 8192 / 1
    mid = ~(high | low)
    assert high.any() and low.any() and mid.any()  # the debug head_dim spans all three bands
    torch.testing.assert_close(scaled[high], plain[high])
    torch.testing.assert_close(scaled[low], plain[low] / 8)
    assert ((scaled[mid] < plain[mid]) & (scaled[mid] > plain[mid] / 8)).all()


def test_init_statistics(debug_model):
    m, args = debug_model, debug_model.args
    trunc3 = math.sqrt(1 - 6 * math.exp(-4.5) / math.sqrt(2 * math.pi) / math.erf(3 / math.sqrt(2)))
    assert m.output.weight.std().item() == pytest.approx(args.dim**-0.5 * trunc3, rel=0.03)
    assert m.output.weight.abs().max().item() <= 3 * args.dim**-0.5 + 1e-6
    assert m.tok_embeddings.weight.std().item() == pytest.approx(1.0, rel=0.03)
    assert m.layers["0"].attention.wq.weight.std().item() == pytest.approx(0.02 * trunc3, rel=0.03)
    for i in (0, 5):
        layer = m.layers[str(i)]
        std = 0.02 / math.sqrt(2 * (i + 1)) * trunc3
        assert layer.attention.wo.weight.std().item() == pytest.approx(std, rel=0.03)
        assert layer.feed_forward.w2.weight.std().item() == pytest.approx(std, rel=0.03)
    assert (m.norm.weight == 1).all() and (m.layers["3"].ffn_norm.weight == 1).all()
    cos, sin = rope_tables(args)  # to_empty left garbage; init_weights must rebuild the tables
    assert torch.equal(m.rope_cos, cos) and torch.equal(m.rope_sin, sin)
    flat = materialize(flavor="llama3_debug", depth_init=False)
    assert flat.layers["0"].attention.wo.weight.std().item() == pytest.approx(
        0.02 / math.sqrt(12) * trunc3, rel=0.03)


def test_pipeline_stages_compose_to_full_model(debug_model):
    first, second = copy.deepcopy(debug_model), copy.deepcopy(debug_model)
    for i in ("3", "4", "5"):
        del first.layers[i]
    first.norm = first.output = None
    for i in ("0", "1", "2"):
        del second.layers[i]
    second.tok_embeddings = None
    assert list(second.layers) == ["3", "4", "5"]  # FQNs survive staging
    torch.manual_seed(0)
    second.init_weights()  # a stage with no embeddings/none modules still initializes
    second.load_state_dict({k: v for k, v in debug_model.state_dict().items() if k in second.state_dict()})
    t = tokens()
    with torch.no_grad():
        hidden = first(t)
        assert hidden.shape == (2, SEQ, 256)
        torch.testing.assert_close(second(hidden), debug_model(t), rtol=0, atol=1e-6)


def test_flops_per_token_debug_by_hand():
    args = flavor_args("llama3_debug")
    # per layer: attention 4*256*256, SwiGLU 3*256*768, two norms 2*256
    per_layer = 4 * 256 * 256 + 3 * 256 * 768 + 2 * 256
    n = 6 * per_layer + 256 + 2048 * 256  # + final norm + output (embedding excluded)
    assert n == 5_639_424
    expected = 6 * n + 12 * 6 * 16 * 16 * 2048
    assert flops_per_token(args, 2048) == expected == 71_585_280
    assert model_flops_per_token(Llama3(flavor="llama3_debug", n_layers=1), 128) == flops_per_token(
        flavor_args("llama3_debug", n_layers=1), 128)


def test_bf16_autocast_forward(debug_model):
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = debug_model(tokens())
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()
    with torch.no_grad():
        ref = debug_model(tokens())
    assert (logits.float() - ref).abs().mean() < 0.05 * ref.abs().mean()


def test_args_validation():
    with pytest.raises(ValueError):
        LlamaArgs(dim=256, n_heads=16, n_kv_heads=5)
