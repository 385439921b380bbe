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

from typing import Any

import torch

from titan_hydra.models.common.hf_decoder import (
    DecoderHFAdapter, ExpertLayout, HFConversionError, check_model_type, decoder_args_of, decoder_hf_config,
    refuse_other_routing, rope_of,
)
from titan_hydra.models.common.moe import MoEArgs
from titan_hydra.models.gpt_oss.model import GptOssArgs, alternating_layer_types


class GptOssHFAdapter(DecoderHFAdapter):
    model_type = "gpt_oss"
    # our suffix within a block -> HF suffix, for what hf_decoder's table does not name
    extra_names = {
        "attention.wq.bias": "self_attn.q_proj.bias",
        "attention.wk.bias": "self_attn.k_proj.bias",
        "attention.wv.bias": "self_attn.v_proj.bias",
        "attention.wo.bias": "self_attn.o_proj.bias",
        "attention.sinks": "self_attn.sinks",
        "feed_forward.router.gate.weight": "mlp.router.weight",
        "feed_forward.router.gate.bias": "mlp.router.bias",
    }
    experts = ExpertLayout(module="mlp", per_expert=False, gate_up="interleave", transposed=True, biases=True)
    no_routing_bias = "HF GPT-OSS has no selection-only routing bias"

    def check_export(self, args: GptOssArgs) -> None:
        refuse_other_routing(args.moe, "HF GPT-OSS routes by softmax over the top-k logits (score_func=softmax, "
                             "route_norm=true) only", score_func="softmax", route_norm=True, num_shared_experts=0)

    def hf_config(self, args: GptOssArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        self.check_export(args)
        moe = args.moe
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
        theta, scaling, rope_type = rope_of(cfg, ("default", "yarn"), "GPT-OSS")
        if scaling.get("attention_factor") is not None or scaling.get("mscale") or scaling.get("mscale_all_dim"):
            raise HFConversionError("GPT-OSS YaRN with attention_factor / mscale overrides is not supported")
        n_layers = int(cfg["num_hidden_layers"])
        kinds = list(cfg.get("layer_types") or alternating_layer_types(n_layers))
        window = cfg.get("sliding_window")
        if window is None and "sliding_attention" in kinds:
            raise HFConversionError("config.json has sliding_attention layers but no sliding_window")
        yarn = rope_type == "yarn"
        return GptOssArgs(
            **decoder_args_of(cfg, norm_eps=1e-5, max_seq_len=131072),
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
            moe=MoEArgs(num_experts=int(cfg["num_local_experts"]), top_k=int(cfg["num_experts_per_tok"]),
                        expert_dim=int(cfg["intermediate_size"]), route_norm=True, load_balance_coeff=0.0,
                        aux_loss_coeff=0.0),
        )
