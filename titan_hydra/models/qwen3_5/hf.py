"""Our Qwen3.5 <-> Hugging Face ``Qwen3_5ForCausalLM`` (``model_type: qwen3_5_text``) checkpoints on disk.

Full-attention layers use Qwen3's names (``self_attn.q_proj`` holds each head's query and output
gate side by side, as our ``wq`` does); Gated DeltaNet layers keep transformers' names under
``linear_attn.``, except that transformers fuses q | k | v: its ``in_proj_qkv.weight`` and
``conv1d.weight`` [C, 1, W] are the row concatenations of our ``in_proj_q`` / ``in_proj_k`` /
``in_proj_v`` and ``conv_q`` / ``conv_k`` / ``conv_v`` weights (``fuse_qkv`` / ``split_qkv``; we keep
them apart so tensor parallel can shard each by heads). The (1 + w) norms store the same w on
both sides. Every other tensor converts unchanged. config.json writes ``layer_types`` as an
explicit list, and the rotary share as ``rope_parameters.partial_rotary_factor``.

The released checkpoints are multimodal (``Qwen3_5ForConditionalGeneration``, ``model_type:
qwen3_5``, the text decoder under ``model.language_model.``): they are refused with one line;
save the text model (``Qwen3_5ForCausalLM``) first.
"""

from __future__ import annotations

from typing import Any

import torch

from titan_hydra.models.common.hf_decoder import (
    DecoderHFAdapter, HFConversionError, check_model_type, decoder_args_of, decoder_hf_config, rope_of,
)
from titan_hydra.models.qwen3_5.model import Qwen35Args

LINEAR_PARAMS = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight", "conv1d.weight",
                 "dt_bias", "A_log", "norm.weight", "out_proj.weight")
LINEAR_NAMES = {f"linear_attn.{p}": f"linear_attn.{p}" for p in LINEAR_PARAMS}
# transformers' fused Gated DeltaNet weight -> our q, k, v parts of it (rows in that order)
FUSED_QKV = {"in_proj_qkv.weight": ("in_proj_q.weight", "in_proj_k.weight", "in_proj_v.weight"),
             "conv1d.weight": ("conv_q.weight", "conv_k.weight", "conv_v.weight")}


def fuse_qkv(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``sd`` with every Gated DeltaNet's q, k, v weights (ours) concatenated into transformers' fused ones."""
    out = dict(sd)
    for fused, parts in FUSED_QKV.items():
        for prefix in [k.removesuffix(parts[0]) for k in sd if k.endswith(parts[0])]:
            out[prefix + fused] = torch.cat([out.pop(prefix + p) for p in parts])
    return out


def split_qkv(sd: dict[str, torch.Tensor], key_dim: int) -> dict[str, torch.Tensor]:
    """``sd`` with transformers' fused q | k | v weights split into ours (``key_dim`` rows of q, of k,
    the rest v)."""
    out = dict(sd)
    for fused, parts in FUSED_QKV.items():
        for prefix in [k.removesuffix(fused) for k in sd if k.endswith(fused)]:
            t = out.pop(prefix + fused)
            out.update({prefix + p: w.contiguous()
                        for p, w in zip(parts, t.split([key_dim, key_dim, t.shape[0] - 2 * key_dim]))})
    return out


def hybrid_hf_config(args, *, architecture: str, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    """config.json fields of Qwen3.5 text models (dense and MoE)."""
    rope = {"rope_type": "default", "rope_theta": float(args.rope_theta),
            "partial_rotary_factor": float(args.partial_rotary_factor)}
    return {**decoder_hf_config(args, architecture=architecture, model_type=model_type,
                                ffn_dim=args.ffn_hidden_dim, head_dim=args.head_dim, rope=rope, dtype=dtype),
            "layer_types": list(args.layer_kinds),
            "linear_conv_kernel_dim": args.linear_conv_kernel_dim,
            "linear_key_head_dim": args.linear_key_head_dim,
            "linear_value_head_dim": args.linear_value_head_dim,
            "linear_num_key_heads": args.linear_num_key_heads,
            "linear_num_value_heads": args.linear_num_value_heads}


def hybrid_args_of(cfg: dict[str, Any], model_type: str, family: str) -> dict[str, Any]:
    """Our args fields from a Qwen3.5 text config.json (refusing what the family cannot express)."""
    if cfg.get("model_type") in ("qwen3_5", "qwen3_5_moe") or "text_config" in cfg:
        raise HFConversionError(f"config.json is the multimodal {family} ({cfg.get('model_type')}); save its text "
                                f"model ({model_type}, *ForCausalLM) and convert that")
    check_model_type(cfg, model_type)
    if cfg.get("attention_bias"):
        raise HFConversionError(f"config.json has attention_bias=true; {family} here has no attention biases")
    theta, scaling, _ = rope_of(cfg, ("default",), family)
    n_layers = int(cfg["num_hidden_layers"])
    interval = int(cfg.get("full_attention_interval", 4))
    return {**decoder_args_of(cfg, norm_eps=1e-6, max_seq_len=32768), "rope_theta": theta,
            "partial_rotary_factor": float(scaling.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))),
            "layer_types": list(cfg.get("layer_types") or [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]),
            "linear_conv_kernel_dim": int(cfg.get("linear_conv_kernel_dim", 4)),
            "linear_key_head_dim": int(cfg.get("linear_key_head_dim", 128)),
            "linear_value_head_dim": int(cfg.get("linear_value_head_dim", 128)),
            "linear_num_key_heads": int(cfg.get("linear_num_key_heads", 16)),
            "linear_num_value_heads": int(cfg.get("linear_num_value_heads", 32))}


def refuse_attention_multiplier(args: Qwen35Args) -> None:
    """muP's attention multiplier cannot fold into a Qwen3.5 checkpoint: the query projection also
    holds the output gate and the QK-norm scales by (1 + w), so no weight scales the scores alone."""
    if float(getattr(args, "attn_mult", 1.0)) != 1.0:
        raise HFConversionError(f"model.attn_mult={args.attn_mult:g} (parametrization=mup) has no counterpart in "
                                "transformers' Qwen3.5 (gated queries, (1 + w) QK-norm): keep this checkpoint in DCP")


class HybridHFAdapter(DecoderHFAdapter):
    """The decoder conversion with the Gated DeltaNet's q, k, v parts fused on export, split on import."""

    extra_names = LINEAR_NAMES

    def to_hf_state(self, sd: dict[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
        return super().to_hf_state(fuse_qkv(sd), args)

    def from_hf_state(self, sd: dict[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
        return split_qkv(super().from_hf_state(sd, args), args.linear_num_key_heads * args.linear_key_head_dim)


class Qwen35HFAdapter(HybridHFAdapter):
    model_type = "qwen3_5_text"

    def check_export(self, args: Qwen35Args) -> None:
        refuse_attention_multiplier(args)

    def hf_config(self, args: Qwen35Args, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        return hybrid_hf_config(args, architecture="Qwen3_5ForCausalLM", model_type=self.model_type, dtype=dtype)

    def args_from_hf_config(self, cfg: dict[str, Any]) -> Qwen35Args:
        return Qwen35Args(**hybrid_args_of(cfg, self.model_type, "Qwen3.5"),
                          ffn_hidden_dim=int(cfg["intermediate_size"]))
