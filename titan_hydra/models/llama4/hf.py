"""Our Llama 4 <-> Hugging Face ``Llama4ForCausalLM`` (``model_type: llama4_text``) checkpoints on disk.

Attention and norms use the Llama-style names; HF's Llama 4 already rotates interleaved pairs
(complex-number rotary), so q/k rows are copied as they are. The feed-forward is named
``feed_forward`` in HF too (not ``mlp``):

* dense layers: ``feed_forward.gate_proj`` / ``up_proj`` / ``down_proj`` <-> our ``w1`` / ``w3`` / ``w2``;
* MoE layers: the router ``feed_forward.router.weight`` [E, dim]; the experts fused and transposed,
  ``feed_forward.experts.gate_up_proj`` [E, dim, 2 x hidden] (gate = first half, up = second) and
  ``down_proj`` [E, hidden, dim], against our ``experts.w1`` / ``w3`` [E, hidden, dim] and ``w2``
  [E, dim, hidden]; the shared expert ``feed_forward.shared_expert.*_proj``.

HF routes by top-k over the logits with sigmoid gates on the expert input and no selection-only
bias: a model whose routing differs, or whose ``expert_bias`` moved (``load_balance_coeff > 0``),
has no HF counterpart and is refused with one line. Meta's multimodal checkpoints
(``Llama4ForConditionalGeneration``, ``model_type: llama4``) keep this text decoder under
``language_model.``: extract it (or save ``Llama4ForCausalLM``) first.
"""

from __future__ import annotations

from typing import Any

import torch

from titan_hydra.models.common.hf_decoder import (
    DecoderHFAdapter, ExpertLayout, HFConversionError, check_model_type, decoder_args_of, decoder_hf_config,
    ffn_names, refuse_other_routing, rope_of,
)
from titan_hydra.models.common.moe import MoEArgs
from titan_hydra.models.llama4.model import Llama4Args


def _flags(ids: list[int], n_layers: int, value: int) -> list[int]:
    """Layer ids -> HF's per-layer 0/1 list (``value`` where the id is listed)."""
    chosen = set(ids)
    return [value if i in chosen else 1 - value for i in range(n_layers)]


class Llama4HFAdapter(DecoderHFAdapter):
    model_type = "llama4_text"
    # our suffix within a block -> HF suffix, where it differs from hf_decoder's table
    extra_names = {
        **ffn_names("feed_forward", "feed_forward"),
        **ffn_names("feed_forward.shared_experts", "feed_forward.shared_expert"),
        "feed_forward.router.gate.weight": "feed_forward.router.weight",
    }
    experts = ExpertLayout(module="feed_forward", per_expert=False, gate_up="concat", transposed=True)
    no_routing_bias = "HF Llama 4 has no selection-only routing bias"

    def check_export(self, args: Llama4Args) -> None:
        refuse_other_routing(args.moe, "HF Llama 4 routes by sigmoid gates on the expert input with one shared "
                             "expert (score_func=sigmoid, route_norm=false, score_before_experts=true, "
                             "num_shared_experts=1) only", score_func="sigmoid", route_norm=False,
                             num_shared_experts=1, score_before_experts=True)
        if args.attn_mult != 1.0 and args.use_qk_norm:
            raise HFConversionError(f"model.attn_mult={args.attn_mult:g} (parametrization=mup) cannot fold into Llama 4's "
                                    "queries: its weightless QK-norm undoes any scale; export needs use_qk_norm=false")

    def moe_layer_ids(self, args: Llama4Args) -> list[int]:
        return args.moe_layer_ids

    def hf_config(self, args: Llama4Args, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        self.check_export(args)
        moe = args.moe
        if args.rope_scaling == "llama3":
            rope = {"rope_type": "llama3", "rope_theta": float(args.rope_theta), "factor": float(args.rope_factor),
                    "low_freq_factor": float(args.rope_low_freq_factor),
                    "high_freq_factor": float(args.rope_high_freq_factor),
                    "original_max_position_embeddings": int(args.rope_original_max_seq_len)}
        else:
            rope = {"rope_type": "default", "rope_theta": float(args.rope_theta)}
        return {**decoder_hf_config(args, architecture="Llama4ForCausalLM", model_type="llama4_text",
                                    ffn_dim=moe.expert_dim, head_dim=args.head_dim, rope=rope, dtype=dtype),
                "intermediate_size_mlp": int(args.ffn_hidden_dim),
                "num_local_experts": moe.num_experts,
                "num_experts_per_tok": moe.top_k,
                "moe_layers": args.moe_layer_ids,
                "no_rope_layers": _flags(args.nope_layer_ids, args.n_layers, 0),  # HF: 1 = this layer uses rope
                "attention_chunk_size": args.attention_chunk_size,
                "use_qk_norm": bool(args.use_qk_norm),
                "attn_temperature_tuning": bool(args.attn_temperature_tuning),
                "floor_scale": int(args.floor_scale) if float(args.floor_scale).is_integer() else args.floor_scale,
                "attn_scale": float(args.attn_scale),
                "router_aux_loss_coef": float(moe.aux_loss_coeff),
                "output_router_logits": False}

    def args_from_hf_config(self, cfg: dict[str, Any]) -> Llama4Args:
        if cfg.get("model_type") == "llama4" or "text_config" in cfg:
            raise HFConversionError("config.json is a multimodal Llama 4 (Llama4ForConditionalGeneration); convert "
                                    "its text decoder: load it with transformers and save Llama4ForCausalLM")
        check_model_type(cfg, "llama4_text")
        if cfg.get("attention_bias"):
            raise HFConversionError("config.json has attention_bias=true; Llama 4 here has no attention biases")
        theta, scaling, rope_type = rope_of(cfg, ("default", "llama3"), "Llama 4")
        n_layers = int(cfg["num_hidden_layers"])
        uses_rope = cfg.get("no_rope_layers") or [int((i + 1) % int(cfg.get("no_rope_layer_interval", 4)) != 0)
                                                  for i in range(n_layers)]
        step = int(cfg.get("interleave_moe_layer_step", 1) or 1)
        moe_layers = cfg.get("moe_layers")
        moe_layers = list(range(step - 1, n_layers, step)) if moe_layers is None else [int(i) for i in moe_layers]
        llama3 = rope_type == "llama3"
        return Llama4Args(
            **decoder_args_of(cfg, norm_eps=1e-5, max_seq_len=131072),
            ffn_hidden_dim=int(cfg.get("intermediate_size_mlp") or cfg["intermediate_size"]),
            rope_theta=theta,
            rope_scaling="llama3" if llama3 else "none",
            rope_factor=float(scaling.get("factor") or 16.0),
            rope_low_freq_factor=float(scaling.get("low_freq_factor") or 1.0),
            rope_high_freq_factor=float(scaling.get("high_freq_factor") or 1.0),
            rope_original_max_seq_len=int(scaling.get("original_max_position_embeddings") or 8192),
            nope_layers=[i for i, flag in enumerate(uses_rope) if not flag],
            attention_chunk_size=cfg.get("attention_chunk_size"),
            use_qk_norm=bool(cfg.get("use_qk_norm", True)),
            attn_temperature_tuning=bool(cfg.get("attn_temperature_tuning", True)),
            floor_scale=float(cfg.get("floor_scale", 8192)),
            attn_scale=float(cfg.get("attn_scale", 0.1)),
            moe_layers=moe_layers,
            moe=MoEArgs(num_experts=int(cfg["num_local_experts"]), top_k=int(cfg.get("num_experts_per_tok", 1)),
                        expert_dim=int(cfg["intermediate_size"]), num_shared_experts=1, score_func="sigmoid",
                        score_before_experts=True, load_balance_coeff=0.0, aux_loss_coeff=0.0),
        )
