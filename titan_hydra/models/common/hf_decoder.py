"""Parameter names of Hugging Face's Llama-style decoders (Llama, Qwen3, ...) and ours.

HF's ``*ForCausalLM`` decoders share one naming scheme (``model.layers.<i>.self_attn.q_proj``,
``mlp.gate_proj``, ``input_layernorm``, ...); families differ in which entries exist (QK-norm)
and in tensor layout (rotary pairing), which their adapters handle.
"""

from __future__ import annotations

import re

import torch

# our suffix within a block -> HF suffix within model.layers.<i>.
BLOCK_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_BLOCK_INV = {v: k for k, v in BLOCK_NAMES.items()}
_TOP_INV = {v: k for k, v in TOP_NAMES.items()}
_OURS_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class HFConversionError(ValueError):
    """A tensor or config that has no counterpart on the other side."""


def to_hf_name(fqn: str) -> str:
    if fqn in TOP_NAMES:
        return TOP_NAMES[fqn]
    m = _OURS_RE.match(fqn)
    if not m or m.group(2) not in BLOCK_NAMES:
        raise HFConversionError(f"no HF name for parameter {fqn!r}")
    return f"model.layers.{m.group(1)}.{BLOCK_NAMES[m.group(2)]}"


def from_hf_name(name: str) -> str:
    if name in _TOP_INV:
        return _TOP_INV[name]
    m = _HF_RE.match(name)
    if not m or m.group(2) not in _BLOCK_INV:
        raise HFConversionError(f"HF tensor {name!r} has no counterpart in this model")
    return f"layers.{m.group(1)}.{_BLOCK_INV[m.group(2)]}"


def refuse_moved_expert_bias(fqn: str, bias: torch.Tensor, hf_model: str) -> None:
    """An MoE export to an HF class without a selection-only routing bias needs ours at 0."""
    if bool((bias != 0).any()):
        raise HFConversionError(
            f"{fqn} is non-zero (trained with model.moe.load_balance_coeff>0); {hf_model} has no selection-only "
            "routing bias, so its expert choices would differ: export needs load_balance_coeff=0")


def decoder_hf_config(args, *, architecture: str, model_type: str, ffn_dim: int, head_dim: int,
                      rope: dict, dtype: torch.dtype) -> dict:
    """config.json fields every Llama-style HF decoder has; a family adds its own keys."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": args.dim,
        "intermediate_size": ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "rope_parameters": rope,
        "hidden_act": "silu",
        "tie_word_embeddings": bool(args.tie_word_embeddings),
        "attention_bias": False,
        "dtype": DTYPE_NAMES.get(dtype, "float32"),
    }


def rope_theta_of(cfg: dict) -> tuple[float, dict]:
    """(rope_theta, scaling dict) from a config.json, new (rope_parameters) or legacy style."""
    rope = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    return float(theta), {**legacy, **rope}


def check_model_type(cfg: dict, expected: str) -> None:
    got = cfg.get("model_type", expected)
    if got != expected:
        raise HFConversionError(f"config.json model_type={got!r}; this family reads {expected!r}")
