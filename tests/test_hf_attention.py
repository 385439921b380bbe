"""``model.attn_implementation``: the platform's attention inside transformers' architectures.

``auto`` routes an architecture that dispatches through transformers' ``AttentionInterface`` (and has
an SDPA path) to ``models/hf/attention.titan_attention``: the kernel policies reach it (the score-matrix
and small-head kernels compute what transformers' eager attention computes, within fp32 rounding), and
packed documents are masked there whatever the architecture did with the position ids (OPT ignores them
for its mask). An architecture outside the table runs transformers' SDPA or eager attention, and the run
header's attention row says so; an explicit ``sdpa`` where there is none is one line naming the key."""

from __future__ import annotations

import pytest
import torch

from titan_hydra.errors import ConfigError
from titan_hydra.kernels.attention_policy import apply_attention_kernel
from titan_hydra.models.hf import FAMILY
from numerics import assert_fp32_close

TINY = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256),
    "gpt2": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=256,
                 max_position_embeddings=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "opt": dict(hidden_size=64, word_embed_proj_dim=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                vocab_size=256, max_position_embeddings=128, dropout=0.0),
    "falcon": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=256),
    "bloom": dict(hidden_size=64, n_layer=2, n_head=4, vocab_size=256),
}


def built(arch: str, mode: str = "auto"):
    args = FAMILY.make_args({"model_type": arch, "fields": TINY[arch], "attn_implementation": mode})
    model = FAMILY.build(args)
    torch.manual_seed(0)
    model.init_weights()
    return args, model.eval()


def eager_twin(args, model):
    """transformers' own model of the same config and weights, on its eager attention."""
    from transformers import AutoModelForCausalLM

    config = type(args.hf_config).from_dict(args.hf_config.to_dict())
    ref = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    ref.load_state_dict(model.state_dict())
    return ref


@pytest.mark.parametrize("arch,implementation,reason", [
    ("llama", "titan", "the platform's attention"), ("gpt2", "titan", "the platform's attention"),
    ("opt", "titan", "the platform's attention"),
    ("falcon", "sdpa", "transformers' falcon attention calls SDPA itself"),
    ("bloom", "eager", "transformers' bloom attention has no SDPA path, so it runs eager"),
])
def test_auto_picks_the_platforms_attention_where_the_architecture_dispatches(arch, implementation, reason):
    args, model = built(arch)
    assert model.config._attn_implementation == implementation
    kernel = apply_attention_kernel(model, "auto", torch.device("cpu"))
    if implementation == "titan":
        assert all(hasattr(m, "causal_kernel") for m in model.modules() if hasattr(m, "scaling"))
    else:
        assert kernel.name == implementation and reason in kernel.reason


@pytest.mark.parametrize("arch,kernel_runs", [("llama", True), ("gpt2", True), ("opt", False)])
def test_the_platforms_kernels_compute_transformers_eager_attention(arch, kernel_runs):
    """The same weights and tokens: through ``titan_attention`` on SDPA, then with the score-matrix
    kernel the policy installs, the logits are transformers' eager ones within fp32 rounding. The
    kernel really runs (its logits are not SDPA's) where the call is plain causal at the 1/sqrt(d)
    scale; OPT scales its queries itself and calls with scale 1, so it stays on SDPA."""
    args, model = built(arch)
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = eager_twin(args, model)(input_ids=tokens).logits
        sdpa = model(tokens)
        assert apply_attention_kernel(model, "scores", torch.device("cpu")).name == "scores"
        scores = model(tokens)
    assert_fp32_close({"sdpa": sdpa, "scores": scores}, {"sdpa": theirs, "scores": theirs})
    assert torch.equal(scores, sdpa) != kernel_runs


@pytest.mark.parametrize("arch", ["opt", "gpt2", "llama"])
def test_packed_documents_are_masked_in_the_platforms_attention(arch):
    """OPT builds its mask without the position ids, so transformers alone would let the second
    document see the first; through ``titan_attention`` it equals the document run alone."""
    _, model = built(arch)
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(2))
    doc_ids = torch.tensor([[0] * 9 + [1] * 15] * 2)
    with torch.no_grad():
        packed, alone, unmasked = model(tokens, doc_ids=doc_ids), model(tokens[:, 9:]), model(tokens)
    assert_fp32_close({"second": packed[:, 9:]}, {"second": alone})
    assert (unmasked[:, 9:] - alone).abs().max() > 1e-3


def test_what_cannot_run_is_one_line():
    with pytest.raises(ConfigError, match=r"^model.attn_implementation=sdpa: transformers' bloom attention has no "
                                          r"SDPA path; use model.attn_implementation=auto \(or eager\)$"):
        built("bloom", "sdpa")
    _, bloom = built("bloom")
    with pytest.raises(ConfigError, match="training.attention_kernel=scores cannot be used: auto: transformers' bloom"):
        apply_attention_kernel(bloom, "scores", torch.device("cpu"))
    with pytest.raises(ValueError, match="model.attn_implementation='flash' is not one of auto, sdpa, eager"):
        built("llama", "flash")
