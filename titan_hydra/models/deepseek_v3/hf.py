"""Our DeepSeek-V3 <-> Hugging Face ``DeepseekV3ForCausalLM`` checkpoints on disk.

What the files hold (checked against transformers 5.23's ``save_pretrained``, and the layout of
deepseek-ai's own release): one tensor per routed expert,
``model.layers.<i>.mlp.experts.<e>.{gate,up,down}_proj.weight``. transformers fuses them into
``gate_up_proj`` / ``down_proj`` in memory and splits them again when saving, so we read and
write the per-expert names, and also accept the fused pair should a file hold it. Our experts
are stacked ``[E, ...]`` tensors (``w1`` = gate, ``w3`` = up, ``w2`` = down). The router's
aux-loss-free bias is ``mlp.gate.e_score_correction_bias`` (our ``expert_bias`` buffer).

Rotary: the released weights rotate interleaved pairs (``rope_interleave: true``); our model
keeps the pairing as a field, so no tensor is permuted in either direction. YaRN settings
travel in ``rope_parameters`` (legacy ``rope_scaling`` + ``rope_theta`` are read too).

Refused with one line: fp8-quantized releases (dequantize first), attention biases, softmax
routing on export (HF's DeepSeek-V3 router is sigmoid-only; our V2-shaped flavors use softmax
like torchtitan's), rope types other than default/yarn.

Multi-token prediction (``model.mtp_layers``, HF ``num_nextn_predict_layers``): depth k is stored
as decoder layer ``model.layers.<n_layers + k>`` (its block under the usual names, always MoE)
plus ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.norm`` (our ``mtp_layers.<k>.norm``).
deepseek-ai's release also stores the shared embedding and head again with the layer
(``embed_tokens``, ``shared_head.head``): export writes those copies, import ignores them (the
model shares the main ones). Import reads as many depths as the config declares and the files
hold: transformers keeps ``num_nextn_predict_layers`` in config.json but saves no MTP weights.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable

import torch

from titan_hydra.models.common.hf_decoder import (
    DTYPE_NAMES, DecoderHFAdapter, ExpertLayout, HFConversionError, check_model_type, rope_of,
)
from titan_hydra.models.deepseek_v3.model import DeepSeekV3Args

# our suffix within layers.<i>. -> HF suffix within model.layers.<i>.
BLOCK_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    # dense layers
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    # MoE layers (routed experts are handled apart: one HF tensor per expert)
    "feed_forward.router.gate.weight": "mlp.gate.weight",
    "feed_forward.expert_bias": "mlp.gate.e_score_correction_bias",
    "feed_forward.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "feed_forward.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}


# our name within mtp_layers.<k>. -> HF's within model.layers.<n_layers + k>. (besides the block's)
MTP_NAMES = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
             "norm.weight": "shared_head.norm.weight"}
MTP_INV = {v: k for k, v in MTP_NAMES.items()}
# copies of the main embedding / head that the release stores with each MTP layer
MTP_SHARED = {"embed_tokens.weight": "tok_embeddings.weight", "shared_head.head.weight": "output.weight"}
_MTP_OURS = re.compile(r"^mtp_layers\.(\d+)\.(.+)$")
_LAYER_OURS = re.compile(r"^layers\.(\d+)\.(.+)$")
_LAYER_HF = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class DeepSeekV3HFAdapter(DecoderHFAdapter):
    model_type = "deepseek_v3"
    block_names = BLOCK_NAMES
    experts = ExpertLayout(module="mlp", per_expert=True)
    skip_layers_beyond_model = True  # multi-token-prediction layers beyond model.mtp_layers

    def hf_layers(self, args: DeepSeekV3Args) -> int:
        return args.n_layers + args.mtp_layers

    def args_for_weights(self, args: DeepSeekV3Args, names: Iterable[str]) -> DeepSeekV3Args:
        """The MTP depths the files hold, up to what config.json declares."""
        names, held = set(names), 0
        while held < args.mtp_layers and f"model.layers.{args.n_layers + held}.eh_proj.weight" in names:
            held += 1
        return args if held == args.mtp_layers else dataclasses.replace(args, mtp_layers=held)

    # --- tensors: the MTP depths around the shared decoder tables --------------------------------
    def to_hf_state(self, sd: dict[str, torch.Tensor], args: DeepSeekV3Args) -> dict[str, torch.Tensor]:
        main, extra = {}, {}
        for fqn, t in sd.items():
            m = _MTP_OURS.match(fqn)
            if m is None:
                main[fqn] = t
                continue
            layer, suffix = args.n_layers + int(m.group(1)), m.group(2)
            if suffix.startswith("block."):
                main[f"layers.{layer}.{suffix.removeprefix('block.')}"] = t
            elif suffix in MTP_NAMES:
                extra[f"model.layers.{layer}.{MTP_NAMES[suffix]}"] = t.contiguous()
            else:
                raise HFConversionError(f"no HF name for parameter {fqn!r}")
        out = super().to_hf_state(main, args)
        for k in range(args.mtp_layers):  # safetensors refuses two names for one storage: copies
            for hf_name, ours in MTP_SHARED.items():
                out[f"model.layers.{args.n_layers + k}.{hf_name}"] = sd[ours].detach().clone()
        return {**out, **extra}

    def from_hf_state(self, sd: dict[str, torch.Tensor], args: DeepSeekV3Args) -> dict[str, torch.Tensor]:
        n = args.n_layers
        main, extra = {}, {}
        for name, t in sd.items():
            m = _LAYER_HF.match(name)
            if m is not None and n <= int(m.group(1)) < n + args.mtp_layers:
                k, suffix = int(m.group(1)) - n, m.group(2)
                if suffix in MTP_SHARED:
                    continue
                if suffix in MTP_INV:
                    extra[f"mtp_layers.{k}.{MTP_INV[suffix]}"] = t
                    continue
            main[name] = t
        out = {}
        for fqn, t in super().from_hf_state(main, args).items():
            m = _LAYER_OURS.match(fqn)
            if m is not None and int(m.group(1)) >= n:
                fqn = f"mtp_layers.{int(m.group(1)) - n}.block.{m.group(2)}"
            out[fqn] = t
        return {**out, **extra}

    # --- config.json --------------------------------------------------------------------------
    def hf_config(self, args: DeepSeekV3Args, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        moe = args.moe
        if moe.score_func != "sigmoid":
            raise HFConversionError(
                f"model.moe.score_func={moe.score_func!r}: HF DeepseekV3ForCausalLM routes with sigmoid scores "
                "only; export needs model.moe.score_func=sigmoid")
        rope: dict[str, Any] = {"rope_type": args.rope_type, "rope_theta": float(args.rope_theta)}
        if args.rope_type == "yarn":
            rope.update(factor=float(args.rope_factor),
                        original_max_position_embeddings=int(args.rope_original_max_seq_len),
                        beta_fast=float(args.beta_fast), beta_slow=float(args.beta_slow),
                        mscale=float(args.mscale), mscale_all_dim=float(args.mscale_all_dim))
        return {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "hidden_size": args.dim,
            "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.n_heads,
            "vocab_size": args.vocab_size,
            "rms_norm_eps": args.norm_eps,
            "max_position_embeddings": args.max_seq_len,
            "q_lora_rank": args.q_lora_rank or None,
            "kv_lora_rank": args.kv_lora_rank,
            "qk_nope_head_dim": args.qk_nope_head_dim,
            "qk_rope_head_dim": args.qk_rope_head_dim,
            "head_dim": args.qk_rope_head_dim,  # what transformers derives and writes (the rotary width)
            "v_head_dim": args.v_head_dim,
            "intermediate_size": args.ffn_hidden_dim,
            "first_k_dense_replace": args.n_dense_layers,
            "moe_intermediate_size": moe.expert_dim,
            "n_routed_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k,
            "n_shared_experts": moe.num_shared_experts,
            "n_group": moe.num_expert_groups,
            "topk_group": moe.num_limited_groups,
            "norm_topk_prob": bool(moe.route_norm),
            "routed_scaling_factor": float(moe.route_scale),
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "num_nextn_predict_layers": int(args.mtp_layers),
            "rope_parameters": rope,
            "rope_interleave": bool(args.rope_interleaved),
            "hidden_act": "silu",
            "tie_word_embeddings": bool(args.tie_word_embeddings),
            "attention_bias": False,
            "dtype": DTYPE_NAMES.get(dtype, "float32"),
        }

    def args_from_hf_config(self, cfg: dict[str, Any]) -> DeepSeekV3Args:
        check_model_type(cfg, "deepseek_v3")
        if cfg.get("quantization_config"):
            method = cfg["quantization_config"].get("quant_method", "?")
            raise HFConversionError(f"config.json has quantization_config ({method}); dequantize the weights to "
                                    "bf16/fp32 first")
        if cfg.get("attention_bias"):
            raise HFConversionError("config.json has attention_bias=true; DeepSeek-V3 here has no attention biases")
        if cfg.get("scoring_func", "sigmoid") != "sigmoid":
            raise HFConversionError(f"config.json has scoring_func={cfg['scoring_func']!r}; DeepSeek-V3 routes "
                                    "with sigmoid scores")
        heads = int(cfg["num_attention_heads"])
        if int(cfg.get("num_key_value_heads") or heads) != heads:
            raise HFConversionError(f"config.json has num_key_value_heads={cfg['num_key_value_heads']} != "
                                    f"num_attention_heads={heads}; MLA has a key and value per head")
        max_seq_len = int(cfg.get("max_position_embeddings", 4096))
        theta, rope, rope_type = rope_of(cfg, ("default", "yarn"), "DeepSeek-V3")
        fields: dict[str, Any] = {"rope_theta": theta, "rope_type": rope_type}
        if rope_type == "yarn":
            if rope.get("attention_factor") is not None or rope.get("truncate", True) is False:
                raise HFConversionError("config.json sets YaRN attention_factor or truncate=false; only DeepSeek's "
                                        "YaRN (factor, beta_fast/slow, mscale, mscale_all_dim) is supported")
            original = int(rope["original_max_position_embeddings"])
            fields.update(
                rope_factor=float(rope.get("factor") or max_seq_len / original),
                rope_original_max_seq_len=original,
                beta_fast=float(rope.get("beta_fast") or 32.0), beta_slow=float(rope.get("beta_slow") or 1.0),
                mscale=float(rope.get("mscale") or 0.0), mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0))
        # a key missing from config.json means transformers' DeepseekV3Config default
        moe = {
            "num_experts": int(cfg.get("n_routed_experts", 256)),
            "top_k": int(cfg.get("num_experts_per_tok", 8)),
            "expert_dim": int(cfg.get("moe_intermediate_size", 2048)),
            "num_shared_experts": int(cfg.get("n_shared_experts", 1)),
            "score_func": "sigmoid",
            "route_norm": bool(cfg.get("norm_topk_prob", True)),
            "route_scale": float(cfg.get("routed_scaling_factor", 2.5)),
            "num_expert_groups": int(cfg.get("n_group", 8)),
            "num_limited_groups": int(cfg.get("topk_group", 4)),
        }
        return DeepSeekV3Args(
            dim=int(cfg["hidden_size"]),
            n_layers=int(cfg["num_hidden_layers"]),
            n_heads=heads,
            vocab_size=int(cfg["vocab_size"]),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_seq_len=max_seq_len,
            q_lora_rank=int(cfg.get("q_lora_rank") or 0),
            kv_lora_rank=int(cfg["kv_lora_rank"]),
            qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
            qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
            v_head_dim=int(cfg["v_head_dim"]),
            n_dense_layers=int(cfg.get("first_k_dense_replace", 3)),
            ffn_hidden_dim=int(cfg["intermediate_size"]),
            moe=moe,
            rope_interleaved=bool(cfg.get("rope_interleave", True)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0),
            **fields,
        )
