"""Our GPT-OSS <-> Hugging Face ``GptOssForCausalLM`` checkpoints on disk (fp32/bf16; not MXFP4).

Attention and norms use the Llama-style names plus biases and ``self_attn.sinks``. The MoE layers
differ in layout: HF keeps every expert projection fused and transposed,
``mlp.experts.gate_up_proj`` [E, dim, 2 x hidden] with gate and up *interleaved* on the last dim
(gate = columns 0, 2, 4, ..., up = 1, 3, 5, ...), ``gate_up_proj_bias`` [E, 2 x hidden] likewise,
``down_proj`` [E, hidden, dim] and ``down_proj_bias`` [E, dim]; the router is
``mlp.router.weight`` / ``.bias``. We hold ``experts.w1`` (gate) / ``w3`` (up) [E, hidden, dim],
``w2`` [E, dim, hidden] and their biases: export transposes and interleaves, import undoes it.

HF's router is softmax over the top-k logits (= our softmax + top-k + renormalize) with no
selection-only bias: a model whose routing differs, or whose ``expert_bias`` moved
(``load_balance_coeff > 0``), has no HF counterpart and is refused with one line.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from titan_hydra.models.common.hf_decoder import (
    HFConversionError, check_model_type, decoder_hf_config, from_hf_name, refuse_moved_expert_bias, rope_theta_of,
    to_hf_name,
)
from titan_hydra.models.common.moe import MoEArgs
from titan_hydra.models.gpt_oss.model import GptOssArgs, alternating_layer_types
from titan_hydra.models.protocol import HFAdapter

# our suffix within a block -> HF suffix, for what hf_decoder's table does not name
EXTRA_NAMES = {
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.wo.bias": "self_attn.o_proj.bias",
    "attention.sinks": "self_attn.sinks",
    "feed_forward.router.gate.weight": "mlp.router.weight",
    "feed_forward.router.gate.bias": "mlp.router.bias",
    "feed_forward.experts.w2": "mlp.experts.down_proj",
    "feed_forward.experts.w2_bias": "mlp.experts.down_proj_bias",
}
_EXTRA_INV = {v: k for k, v in EXTRA_NAMES.items()}
_BLOCK = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_BLOCK = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_FUSED = {"feed_forward.experts.w1": ("mlp.experts.gate_up_proj", 0),
          "feed_forward.experts.w3": ("mlp.experts.gate_up_proj", 1),
          "feed_forward.experts.w1_bias": ("mlp.experts.gate_up_proj_bias", 0),
          "feed_forward.experts.w3_bias": ("mlp.experts.gate_up_proj_bias", 1)}


def _check_representable(moe: MoEArgs) -> None:
    if (moe.score_func != "softmax" or not moe.route_norm or moe.route_scale != 1.0 or moe.num_shared_experts
            or moe.num_expert_groups > 1):
        raise HFConversionError(
            "HF GPT-OSS routes by softmax over the top-k logits (score_func=softmax, route_norm=true) only; "
            f"this model has score_func={moe.score_func}, route_norm={moe.route_norm}, route_scale={moe.route_scale}, "
            f"num_shared_experts={moe.num_shared_experts}, num_expert_groups={moe.num_expert_groups}")


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[..., hidden] x 2 -> [..., 2 x hidden] with gate on even and up on odd positions."""
    return torch.stack((gate, up), dim=-1).flatten(-2)


class GptOssHFAdapter(HFAdapter):
    model_type = "gpt_oss"

    def to_hf_state(self, sd: dict[str, torch.Tensor], args: GptOssArgs) -> dict[str, torch.Tensor]:
        _check_representable(args.moe)
        out: dict[str, torch.Tensor] = {}
        for fqn, t in sd.items():
            if fqn == "output.weight" and args.tie_word_embeddings:
                continue
            m = _BLOCK.match(fqn)
            if m is None:
                out[to_hf_name(fqn)] = t.contiguous()
                continue
            layer, suffix = m.groups()
            prefix = f"model.layers.{layer}"
            if suffix == "feed_forward.expert_bias":
                refuse_moved_expert_bias(fqn, t, "HF GPT-OSS")
            elif suffix in _FUSED:
                if _FUSED[suffix][1] == 0:  # emit the fused tensor once, at the gate's entry
                    up = sd[f"layers.{layer}.{suffix.replace('w1', 'w3')}"]
                    if t.dim() == 3:  # weights [E, hidden, dim] -> HF's [E, dim, hidden]
                        t, up = t.transpose(1, 2), up.transpose(1, 2)
                    out[f"{prefix}.{_FUSED[suffix][0]}"] = _interleave(t, up).contiguous()
            elif suffix == "feed_forward.experts.w2":
                out[f"{prefix}.mlp.experts.down_proj"] = t.transpose(1, 2).contiguous()
            elif suffix in EXTRA_NAMES:
                out[f"{prefix}.{EXTRA_NAMES[suffix]}"] = t.contiguous()
            else:
                out[to_hf_name(fqn)] = t.contiguous()
        return out

    def from_hf_state(self, sd: dict[str, torch.Tensor], args: GptOssArgs) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, t in sd.items():
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and args.tie_word_embeddings):
                continue
            m = _HF_BLOCK.match(name)
            suffix = m.group(2) if m else None
            if suffix == "mlp.experts.gate_up_proj":  # [E, dim, 2h] -> w1, w3 [E, h, dim]
                ours = f"layers.{m.group(1)}.feed_forward.experts"
                out[f"{ours}.w1"] = t[..., 0::2].transpose(1, 2).contiguous()
                out[f"{ours}.w3"] = t[..., 1::2].transpose(1, 2).contiguous()
            elif suffix == "mlp.experts.gate_up_proj_bias":
                ours = f"layers.{m.group(1)}.feed_forward.experts"
                out[f"{ours}.w1_bias"], out[f"{ours}.w3_bias"] = t[..., 0::2].contiguous(), t[..., 1::2].contiguous()
            elif suffix == "mlp.experts.down_proj":
                out[f"layers.{m.group(1)}.feed_forward.experts.w2"] = t.transpose(1, 2).contiguous()
            elif suffix in _EXTRA_INV:
                out[f"layers.{m.group(1)}.{_EXTRA_INV[suffix]}"] = t
            else:
                out[from_hf_name(name)] = t
        for i in range(args.n_layers):  # HF has no selection-only bias: ours starts at 0
            out[f"layers.{i}.feed_forward.expert_bias"] = torch.zeros(args.moe.num_experts, dtype=torch.float32)
        if args.tie_word_embeddings and "tok_embeddings.weight" in out:
            out["output.weight"] = out["tok_embeddings.weight"]
        return out

    def hf_config(self, args: GptOssArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        moe = args.moe
        _check_representable(moe)
        if args.rope_type == "yarn":
            rope = {"rope_type": "yarn", "rope_theta": float(args.rope_theta), "factor": float(args.rope_factor),
                    "original_max_position_embeddings": int(args.rope_original_max_seq_len),
                    "beta_fast": float(args.beta_fast), "beta_slow": float(args.beta_slow),
                    "truncate": bool(args.rope_truncate)}
        else:
            rope = {"rope_type": "default", "rope_theta": float(args.rope_theta)}
        return {**decoder_hf_config(args, architecture="GptOssForCausalLM", model_type="gpt_oss",
                                    ffn_dim=moe.expert_dim, head_dim=args.head_dim, rope=rope, dtype=dtype),
                "attention_bias": bool(args.attention_bias),
                "sliding_window": int(args.sliding_window),
                "layer_types": args.layer_kinds,
                "num_local_experts": moe.num_experts,
                "num_experts_per_tok": moe.top_k,
                "swiglu_alpha": float(args.swiglu_alpha),
                "swiglu_limit": float(args.swiglu_limit),
                "router_aux_loss_coef": float(moe.aux_loss_coeff),
                "output_router_logits": False}

    def args_from_hf_config(self, cfg: dict[str, Any]) -> GptOssArgs:
        check_model_type(cfg, "gpt_oss")
        if cfg.get("quantization_config"):
            raise HFConversionError("config.json has a quantization_config (MXFP4 experts); convert a dequantized "
                                    "(bf16/fp32) checkpoint, e.g. one saved by transformers after loading")
        theta, scaling = rope_theta_of(cfg)
        rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type not in ("default", "yarn"):
            raise HFConversionError(f"rope type {rope_type!r} is not supported for GPT-OSS (default or yarn)")
        if scaling.get("attention_factor") is not None or scaling.get("mscale") or scaling.get("mscale_all_dim"):
            raise HFConversionError("GPT-OSS YaRN with attention_factor / mscale overrides is not supported")
        n_layers = int(cfg["num_hidden_layers"])
        kinds = list(cfg.get("layer_types") or alternating_layer_types(n_layers))
        window = cfg.get("sliding_window")
        if window is None and "sliding_attention" in kinds:
            raise HFConversionError("config.json has sliding_attention layers but no sliding_window")
        heads = int(cfg["num_attention_heads"])
        yarn = rope_type == "yarn"
        return GptOssArgs(
            dim=int(cfg["hidden_size"]),
            n_layers=n_layers,
            n_heads=heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            vocab_size=int(cfg["vocab_size"]),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            max_seq_len=int(cfg.get("max_position_embeddings", 131072)),
            attention_bias=bool(cfg.get("attention_bias", True)),
            sliding_window=int(window or 128),
            layer_types=None if kinds == alternating_layer_types(n_layers) else kinds,
            rope_theta=theta,
            rope_type=rope_type,
            rope_factor=float(scaling.get("factor") or 1.0) if yarn else 32.0,
            rope_original_max_seq_len=int(scaling.get("original_max_position_embeddings") or 4096),
            beta_fast=float(scaling.get("beta_fast") or 32.0),
            beta_slow=float(scaling.get("beta_slow") or 1.0),
            rope_truncate=bool(scaling.get("truncate", True)) if yarn else False,
            swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            moe=MoEArgs(num_experts=int(cfg["num_local_experts"]), top_k=int(cfg["num_experts_per_tok"]),
                        expert_dim=int(cfg["intermediate_size"]), route_norm=True, load_balance_coeff=0.0,
                        aux_loss_coeff=0.0),
        )
