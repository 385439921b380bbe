"""HF safetensors in and out, per family: names, rotary layout, tied embeddings, config.json,
round trips, logits (Llama <-> LlamaForCausalLM, Qwen3 <-> Qwen3ForCausalLM, Qwen3-MoE <->
Qwen3MoeForCausalLM: per-expert tensors on disk, stacked experts in our model; DeepSeek-V3 <->
DeepseekV3ForCausalLM: MLA, YaRN, group-limited sigmoid routing with its expert bias; GPT-OSS <->
GptOssForCausalLM: sinks, a sliding-window layer, untruncated YaRN, biased experts with the
clamped SwiGLU, fused interleaved gate/up tensors)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from titan_hydra.checkpoint import convert  # read_model, to_hf, from_hf
from helpers import model_logits
from titan_hydra.spec import spec_of
from titan_hydra.checkpoint import CheckpointError  # noqa: E402
from titan_hydra.checkpoint.state import FORMAT_VERSION  # noqa: E402
from titan_hydra.checkpoint.storage import save_plain  # noqa: E402
from titan_hydra.models.hf_io import load_hf_checkpoint  # noqa: E402
from titan_hydra.models.llama3 import FAMILY as LLAMA  # noqa: E402
from titan_hydra.models.llama3 import Llama3  # noqa: E402
from titan_hydra.models.llama3.hf import from_hf_rows, to_hf_rows  # noqa: E402
from titan_hydra.models.qwen3 import FAMILY as QWEN3  # noqa: E402
from titan_hydra.models.qwen3 import Qwen3  # noqa: E402
from titan_hydra.models.qwen3_moe import FAMILY as QWEN3_MOE  # noqa: E402
from titan_hydra.models.qwen3_moe import Qwen3Moe  # noqa: E402
from titan_hydra.models.deepseek_v3 import FAMILY as DEEPSEEK_V3  # noqa: E402
from titan_hydra.models.deepseek_v3 import DeepSeekV3  # noqa: E402
from titan_hydra.models.gpt_oss import FAMILY as GPT_OSS  # noqa: E402
from titan_hydra.models.gpt_oss import GptOss  # noqa: E402
from titan_hydra.models.llama4 import FAMILY as LLAMA4  # noqa: E402
from titan_hydra.models.llama4 import Llama4  # noqa: E402
from numerics import U32, assert_fp32_close  # noqa: E402

transformers = pytest.importorskip("transformers")

VOCAB = 128
TOKENS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
HF_CLASSES = {"llama": transformers.LlamaForCausalLM, "qwen3": transformers.Qwen3ForCausalLM,
              "qwen3_moe": transformers.Qwen3MoeForCausalLM, "deepseek_v3": transformers.DeepseekV3ForCausalLM,
              "gpt_oss": transformers.GptOssForCausalLM, "llama4_text": transformers.Llama4ForCausalLM}
HF_CONFIGS = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config,
              "qwen3_moe": transformers.Qwen3MoeConfig, "deepseek_v3": transformers.DeepseekV3Config,
              "gpt_oss": transformers.GptOssConfig, "llama4_text": transformers.Llama4TextConfig}
FAMILIES = {"llama": LLAMA, "qwen3": QWEN3, "qwen3_moe": QWEN3_MOE, "deepseek_v3": DEEPSEEK_V3, "gpt_oss": GPT_OSS,
            "llama4_text": LLAMA4}
# Our logits vs HF's (fp32): neither side has an fp64 form (both compute norms and rotary in fp32
# whatever the dtype), so the bound is from first principles: fp32 unit roundoff times 2e3 terms
# (2-3 layers whose sums along the path have <= 600 terms: dim 64, FFN 96, 16 tokens) of the
# largest logit, 1.2e-4 of it.
# Measured max |diff| (OMP_NUM_THREADS=1; logits std 0.8-1.3, max |logit| ~3.5):
#   HF -> ours: llama untied 1.7e-06, tied 1.8e-06; qwen3 untied 1.9e-06, tied 1.4e-06
#   ours -> HF: llama untied 1.2e-07, tied 9.5e-07; qwen3 untied 6.0e-07, tied 9.5e-07
#   qwen3_moe (untied, layer 0 dense): HF -> ours 1.2e-06, ours -> HF 9.5e-07
#   deepseek_v3 (YaRN, layer 0 dense; q_lora_rank 0 untied / 24 tied): HF -> ours 2.1e-06 / 2.1e-06,
#     ours -> HF 2.4e-07 / 1.8e-07
#   gpt_oss (window 5 on layer 0, sinks, swiglu_limit 1.0): HF -> ours 1.1e-06, ours -> HF 7.2e-07
#   llama4_text (chunk 5, NoPE layer 1 with temperature tuning, QK-norm, llama3 x4 rotary): HF -> ours 1.4e-06
TINY_REL = 2e3 * U32
# DeepSeek-V3: MLA (latent 16, rope 8 / nope 16 / v 12 per head), YaRN with mscale != mscale_all_dim
# (so the cos/sin multiplier and the softmax correction both differ from 1), 8 experts of width 32,
# top-2 in 1 of 2 groups with a shared expert, layer 0 dense. "tied" rows also use a query LoRA.
DS_MLA = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12)
DS_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
               beta_fast=32.0, beta_slow=1.0, mscale=0.8, mscale_all_dim=0.6)
HF_DS_MOE = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                 n_group=2, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5)
# Qwen3-MoE: 4 experts of width 48, top-2 renormalized; layer 0 dense (HF mlp_only_layers=[0]).
HF_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
              mlp_only_layers=[0])
# GPT-OSS: layer 0 sliding (window 5 < the 16 tokens), layer 1 full, sinks and biases, 4 experts of width
# 96 top-2, a SwiGLU clamp of 1.0 that the activations reach, YaRN with truncate false (HF's gpt_oss).
GPT_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
                beta_fast=32.0, beta_slow=1.0, truncate=False)
HF_GPT_OSS = dict(head_dim=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=5, swiglu_limit=1.0,
                  rope_parameters=GPT_YARN)
# Llama 4: 3 layers, layer 1 NoPE (interval 2) with temperature tuning from position 3 on (floor 4,
# scale 0.5), layers 0 and 2 rotary in 5-token chunks with QK-norm; layer 0 dense (width 96), layers 1-2
# MoE (4 experts of width 48, sigmoid top-1 on the input, a shared expert); Scout's llama3 rotary rule.
L4_ROPE = dict(rope_type="llama3", rope_theta=10000.0, factor=4.0, low_freq_factor=1.0, high_freq_factor=1.0,
               original_max_position_embeddings=16)
HF_LLAMA4 = dict(num_hidden_layers=3, intermediate_size=48, intermediate_size_mlp=96, head_dim=32, num_local_experts=4,
                 num_experts_per_tok=1, moe_layers=[1, 2], no_rope_layer_interval=2, attention_chunk_size=5,
                 floor_scale=4, attn_scale=0.5, use_qk_norm=True, rope_parameters=L4_ROPE)
OUR_MOE = dict(n_dense_layers=1, moe=dict(num_experts=4, top_k=2, expert_dim=48, route_norm=True,
                                          load_balance_coeff=0.0))


def hf_config(kind: str, tied: bool):
    """A tiny HF config: GQA, an intermediate size not from Meta's rule, and for Qwen3 a head_dim
    (32) that is not hidden/heads (16)."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=tied, initializer_range=0.1)
    if kind == "deepseek_v3":
        return transformers.DeepseekV3Config(**(common | dict(num_key_value_heads=4)), **DS_MLA, **HF_DS_MOE,
                                             q_lora_rank=24 if tied else None, rope_parameters=DS_YARN)
    if kind == "gpt_oss":
        return transformers.GptOssConfig(**common, **HF_GPT_OSS)
    if kind == "llama4_text":
        return transformers.Llama4TextConfig(**(common | HF_LLAMA4))
    if kind == "llama":
        return transformers.LlamaConfig(**common, rms_norm_eps=1e-5,
                                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return HF_CONFIGS[kind](**common, head_dim=32, rms_norm_eps=1e-6, **(HF_MOE if kind == "qwen3_moe" else {}),
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def randomize_norms(model: torch.nn.Module) -> None:
    """Norm weights start at 1; make them distinct so a swapped name (q_norm/k_norm, input/post
    layernorm) cannot go unnoticed."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
        # DeepSeek-V3's routing bias (HF e_score_correction_bias); HF's Qwen3-MoE / GPT-OSS / Llama 4 have none, ours stays 0
        for name, b in model.named_buffers():
            no_routing_bias = isinstance(model, (Qwen3Moe, GptOss, Llama4))
            if name.endswith(("e_score_correction_bias", "expert_bias")) and not no_routing_bias:
                b.copy_(0.05 * torch.randn_like(b))
        # GPT-OSS's biases and sinks start at 0 (ours) or near it (HF): make them count
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.copy_(0.3 * torch.randn_like(p))


CASES = [("llama", False), ("llama", True), ("qwen3", False), ("qwen3", True), ("qwen3_moe", False),
         ("deepseek_v3", False), ("deepseek_v3", True), ("gpt_oss", False), ("llama4_text", False)]
IDS = [f"{k}-{'tied' if t else 'untied'}" for k, t in CASES]


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def hf_dir(request, tmp_path_factory):
    """A tiny random HF model (fp32) saved locally; returns (kind, tied, path)."""
    kind, tied = request.param
    torch.manual_seed(0)
    model = HF_CLASSES[kind](hf_config(kind, tied))
    randomize_norms(model)
    path = tmp_path_factory.mktemp("hf") / f"{kind}-{tied}"
    model.save_pretrained(path)
    return kind, tied, path


def hf_logits(kind: str, path: Path) -> torch.Tensor:
    model = HF_CLASSES[kind].from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(TOKENS).logits


def our_logits(ckpt: Path) -> torch.Tensor:
    return model_logits(*convert.read_model(ckpt), TOKENS)


def test_rotary_permutation_is_inverse():
    w = torch.randn(4 * 16, 8)
    assert torch.equal(from_hf_rows(to_hf_rows(w, 4), 4), w)
    assert not torch.equal(to_hf_rows(w, 4), w)


def test_hf_to_ours_to_hf(hf_dir, tmp_path):
    """HF -> ours -> HF is tensor-identical; our model reproduces HF's logits."""
    from safetensors.torch import load_file

    kind, tied, path = hf_dir
    convert.from_hf(path, tmp_path / "ckpt" / "step-0")
    family, args, sd = convert.read_model(tmp_path / "ckpt" / "step-0")
    assert family is FAMILIES[kind] and args.tie_word_embeddings == tied
    if kind in ("qwen3", "qwen3_moe"):
        assert (args.head_dim, args.dim // args.n_heads, args.qk_norm) == (32, 16, True)
    if kind == "deepseek_v3":
        assert (args.q_lora_rank, args.rope_type, args.mscale_all_dim, args.moe.num_expert_groups) == (
            24 if tied else 0, "yarn", 0.6, 2)
        assert sd["layers.1.feed_forward.experts.w2"].shape == (8, 64, 32)
        assert sd["layers.1.feed_forward.expert_bias"].abs().min() > 0
    if kind == "gpt_oss":
        assert (args.sliding_window, args.layer_kinds, args.rope_truncate, args.swiglu_limit, args.head_dim) == (
            5, ["sliding_attention", "full_attention"], False, 1.0, 32)
        assert sd["layers.1.feed_forward.experts.w1"].shape == (4, 96, 64)
        assert sd["layers.0.attention.sinks"].abs().min() > 0
    if kind == "llama4_text":
        assert (args.nope_layer_ids, args.moe_layer_ids, args.attention_chunk_size, args.rope_scaling) == (
            [1], [1, 2], 5, "llama3")
        assert sd["layers.1.feed_forward.experts.w1"].shape == (4, 48, 64)
        assert sd["layers.0.feed_forward.w1.weight"].shape == (96, 64)
    if kind == "qwen3_moe":
        assert args.n_dense_layers == 1 and args.moe.num_experts == 4 and args.moe.route_norm
        assert sd["layers.1.feed_forward.experts.w1"].shape == (4, 48, 64)
    convert.to_hf(tmp_path / "ckpt" / "step-0", tmp_path / "back")
    a, b = load_file(str(path / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert a.keys() == b.keys()
    assert ("lm_head.weight" in a) == (not tied)
    assert all(torch.equal(a[k], b[k]) for k in a)
    ref = hf_logits(kind, path)
    assert_fp32_close({"logits": our_logits(tmp_path / "ckpt" / "step-0")}, {"logits": ref}, rel=TINY_REL)
    assert torch.equal(hf_logits(kind, tmp_path / "back"), ref)
    cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    assert cfg["model_type"] == kind and cfg["tie_word_embeddings"] == tied


def make_ours(kind: str, tied: bool):
    torch.manual_seed(0)
    if kind == "llama":
        model = Llama3(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=64,
                       rope_scaling=True, rope_theta=500000.0, tie_word_embeddings=tied)
    elif kind == "gpt_oss":
        model = GptOss(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=VOCAB, max_seq_len=64,
                       sliding_window=5, rope_theta=10000.0, rope_factor=4.0, rope_original_max_seq_len=16,
                       swiglu_limit=1.0, moe=dict(num_experts=4, top_k=2, expert_dim=96, route_norm=True,
                                                  load_balance_coeff=0.0))
    elif kind == "llama4_text":
        model = Llama4(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=VOCAB, max_seq_len=64,
                       ffn_hidden_dim=96, rope_theta=10000.0, rope_factor=4.0, rope_original_max_seq_len=16,
                       nope_interval=2, attention_chunk_size=5, floor_scale=4, attn_scale=0.5, moe_layers=[1, 2],
                       moe=dict(num_experts=4, top_k=1, expert_dim=48, num_shared_experts=1, score_func="sigmoid",
                                score_before_experts=True, load_balance_coeff=0.0))
    elif kind == "deepseek_v3":
        model = DeepSeekV3(dim=64, n_layers=2, n_heads=4, vocab_size=VOCAB, max_seq_len=64,
                           q_lora_rank=24 if tied else 0, **DS_MLA, n_dense_layers=1, ffn_hidden_dim=96,
                           rope_factor=4.0, rope_original_max_seq_len=16, mscale=0.8, mscale_all_dim=0.6,
                           tie_word_embeddings=tied,
                           moe=dict(num_experts=8, top_k=2, expert_dim=32, num_shared_experts=1, score_func="sigmoid",
                                    route_norm=True, route_scale=2.5, num_expert_groups=2, num_limited_groups=1))
    else:
        cls, extra = (Qwen3Moe, OUR_MOE) if kind == "qwen3_moe" else (Qwen3, {})
        model = cls(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, ffn_hidden_dim=96,
                    vocab_size=VOCAB, max_seq_len=64, tie_word_embeddings=tied, **extra)
    model.init_weights()
    randomize_norms(model)
    return FAMILIES[kind], model


@pytest.mark.parametrize("kind,tied", CASES, ids=IDS)
def test_ours_to_hf_to_ours(tmp_path, kind, tied):
    """A checkpoint of our model exports to HF (same logits there) and re-imports with equal logits."""
    family, model = make_ours(kind, tied)
    marker = {"format": FORMAT_VERSION, "step": 3, "kind": "full",
              "model": {"family": family.name, "flavor": "custom", "args": family.args_fields(model.args),
                        "signature": family.signature(model.args)}}
    sd = model.state_dict()
    if tied:
        assert sd["output.weight"].data_ptr() == sd["tok_embeddings.weight"].data_ptr()
    save_plain(tmp_path / "step-3", {f"model.{k}": v.clone() for k, v in sd.items()}, marker)
    before = our_logits(tmp_path / "step-3")
    convert.to_hf(tmp_path / "step-3", tmp_path / "hf")
    assert_fp32_close({"logits": hf_logits(kind, tmp_path / "hf")}, {"logits": before}, rel=TINY_REL)
    convert.from_hf(tmp_path / "hf", tmp_path / "again" / "step-0")
    assert torch.equal(our_logits(tmp_path / "again" / "step-0"), before)


def edited_copy(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("hf") / "qwen3"
    transformers.Qwen3ForCausalLM(hf_config("qwen3", False)).save_pretrained(path)
    return path


@pytest.mark.parametrize("key", ["use_sliding_window", "attention_bias"])
def test_qwen3_unsupported_features_refused(qwen3_dir, tmp_path, key):
    bad = edited_copy(qwen3_dir, tmp_path / "bad", **{key: True})
    with pytest.raises(CheckpointError, match=rf"HF checkpoint {bad}: .*{key}=true") as err:
        convert.from_hf(bad, tmp_path / "out")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_hf_dir_of_another_family_refused(qwen3_dir, tmp_path):
    # the run fixes the family (initial_load_path of a llama3 run): a qwen3 directory is refused
    with pytest.raises(CheckpointError, match=r"model_type='qwen3', but this run's model family 'llama3' reads 'llama'") as err:
        load_hf_checkpoint(qwen3_dir, LLAMA)
    assert "\n" not in str(err.value)
    # no family given: picked from model_type; an unknown one is named with the known ones
    family, args, _ = load_hf_checkpoint(qwen3_dir)
    assert family is QWEN3 and args.head_dim == 32
    # (a type transformers has a causal LM for, with no native port, is read by model=hf: test_hf_family.py)
    other = edited_copy(qwen3_dir, tmp_path / "my_arch", model_type="my_arch")
    with pytest.raises(CheckpointError, match=r"model_type='my_arch' is not supported \(known: llama, qwen3, qwen3_moe, deepseek_v3, gpt_oss, llama4_text, qwen3_5_text, qwen3_5_moe_text, qwen3_next, FluxTransformer2DModel; or any transformers causal LM\)") as err:
        convert.from_hf(other, tmp_path / "out")
    assert "\n" not in str(err.value)
    with pytest.raises(CheckpointError, match="model_type='my_arch'"):
        load_hf_checkpoint(other, QWEN3)


# ------------------------------------------------------------------ initial_load_path=<HF dir>

# A run's first loss, after checkpoint.initial_load_path=<HF dir>, equals HF's own loss on the
# same first batch: the weights arrived (names, rotary layout, tying) through the engine's path.
RUN_SHAPES = {
    "llama": (["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2"],
              dict(intermediate_size=256, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "qwen3": (["model=qwen3_debug", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
               "model.head_dim=32", "model.ffn_hidden_dim=192"],
              dict(intermediate_size=192, head_dim=32, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True)),
    "qwen3_moe": (["model=qwen3_moe_debug", "model.dim=64", "model.n_layers=2", "model.n_heads=4",
                   "model.n_kv_heads=2", "model.head_dim=32", "model.moe.num_experts=4", "model.moe.expert_dim=48"],
                  dict(intermediate_size=768, head_dim=32, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True)),
    # deepseek_v3_debug narrowed; its YaRN (factor 4 over 512 positions, mscale 1) and routing as in the yaml
    "deepseek_v3": (["model=deepseek_v3_debug", "model.dim=64", "model.n_layers=2", "model.n_heads=4",
                     "model.kv_lora_rank=16", "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=8",
                     "model.v_head_dim=12", "model.ffn_hidden_dim=96", "model.moe.expert_dim=32"],
                    dict(DS_MLA, **HF_DS_MOE, intermediate_size=96, num_key_value_heads=4, q_lora_rank=None,
                         rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                         rope_parameters=dict(DS_YARN, original_max_position_embeddings=512, mscale=1.0,
                                              mscale_all_dim=1.0))),
    # gpt_oss_debug narrowed, window 8 (< seq 32); its YaRN as released (factor 32 over 4096, untruncated)
    "gpt_oss": (["model=gpt_oss_debug", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
                 "model.head_dim=16", "model.sliding_window=8", "model.moe.num_experts=4", "model.moe.expert_dim=48"],
                dict(intermediate_size=48, head_dim=16, rope_theta=150000.0, rms_norm_eps=1e-5,
                     tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                     rope_parameters=dict(GPT_YARN, rope_theta=150000.0, factor=32.0,
                                          original_max_position_embeddings=4096))),
}


@pytest.mark.parametrize("kind", list(RUN_SHAPES))
def test_initial_load_path_reads_an_hf_directory(tmp_path, kind):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from helpers import compose_cfg

    from titan_hydra.models.objective import cross_entropy_loss
    from titan_hydra.train.pretrain import run
    from titan_hydra.train.services import build_dataset

    overrides, hf_fields = RUN_SHAPES[kind]
    rope = hf_fields.pop("rope_theta")
    hf_cfg = HF_CONFIGS[kind](**{**dict(vocab_size=2048, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=2048,
                                        rope_parameters={"rope_type": "default", "rope_theta": rope}), **hf_fields})
    torch.manual_seed(0)
    hf_model = HF_CLASSES[kind](hf_cfg).eval()
    randomize_norms(hf_model)
    hf_model.save_pretrained(tmp_path / "hf")
    cfg = compose_cfg(overrides + [
        "training.seq_len=32", "training.local_batch_size=2", "training.steps=1", "training.val_freq=0",
        "training.mixed_precision=fp32", "lr_scheduler.warmup_steps=0", "data.max_documents=40", "logger=minimal",
        f"checkpoint.initial_load_path={tmp_path / 'hf'}",
    ])
    inputs, labels = next(build_dataset(spec_of(cfg).data).loader("train", 2))
    with torch.no_grad():
        expected = cross_entropy_loss(hf_model(inputs).logits, labels).item()
    got = run(spec_of(cfg), str(tmp_path / "run"))["losses"][0]
    # the same logits' cross entropy, both sides without an fp64 form: 2 layers of dim 64 and a 2048-way
    # logsumexp, fp32 unit roundoff times 1e4 terms (numerics.FP32_REL) of the loss
    assert_fp32_close({"loss": torch.tensor(got)}, {"loss": torch.tensor(expected)})
