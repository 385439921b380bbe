"""Our Qwen3-MoE <-> Hugging Face ``Qwen3MoeForCausalLM`` checkpoints on disk.

Attention, norms and dense layers are named as in Qwen3. The MoE layers differ in layout:
HF's files hold one tensor per expert and projection (``mlp.experts.<j>.gate_proj.weight``
[expert_dim, dim], ``up_proj``, ``down_proj`` [dim, expert_dim]) and the router as
``mlp.gate.weight`` [E, dim]; we hold each projection of all experts stacked
(``experts.w1`` [E, expert_dim, dim] = gate, ``w3`` = up, ``w2`` [E, dim, expert_dim] = down).
Export splits, import stacks. Import also accepts the fused in-memory layout some tools write
(``mlp.experts.gate_up_proj`` [E, 2 x expert_dim, dim], gate rows first, and
``mlp.experts.down_proj``).

HF's Qwen3-MoE routes with a softmax over all experts, top-k, optional renormalization, and no
bias: a model whose routing needs more (sigmoid, scaled gates, groups, shared experts, a
non-zero ``expert_bias`` from aux-loss-free balancing) has no HF counterpart and is refused
with one line rather than exported with different behaviour.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from titan_hydra.models.common.hf_decoder import (
    HFConversionError, check_model_type, decoder_hf_config, from_hf_name, rope_theta_of, to_hf_name,
)
from titan_hydra.models.common.moe import MoEArgs
from titan_hydra.models.protocol import HFAdapter
from titan_hydra.models.qwen3_moe.model import Qwen3MoeArgs

# our stacked expert weight -> HF per-expert projection
EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_HF_PROJ = {v: k for k, v in EXPERT_NAMES.items()}
_OUR_MOE = re.compile(r"^layers\.(\d+)\.feed_forward\.(router\.gate\.weight|expert_bias|experts\.(w[123]))$")
_HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_HF_FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_HF_GATE = re.compile(r"^model\.layers\.(\d+)\.mlp\.gate\.weight$")


def _check_representable(moe: MoEArgs) -> None:
    if moe.score_func != "softmax" or moe.route_scale != 1.0 or moe.num_shared_experts or moe.num_expert_groups > 1:
        raise HFConversionError(
            "HF Qwen3-MoE routes by softmax top-k only; this model has "
            f"score_func={moe.score_func}, route_scale={moe.route_scale}, "
            f"num_shared_experts={moe.num_shared_experts}, num_expert_groups={moe.num_expert_groups}")


class Qwen3MoeHFAdapter(HFAdapter):
    model_type = "qwen3_moe"

    def to_hf_state(self, sd: dict[str, torch.Tensor], args: Qwen3MoeArgs) -> dict[str, torch.Tensor]:
        _check_representable(args.moe)
        out: dict[str, torch.Tensor] = {}
        for fqn, t in sd.items():
            if fqn == "output.weight" and args.tie_word_embeddings:
                continue
            m = _OUR_MOE.match(fqn)
            if m is None:
                out[to_hf_name(fqn)] = t.contiguous()
                continue
            layer, what, w = m.groups()
            prefix = f"model.layers.{layer}.mlp"
            if what == "expert_bias":
                if bool((t != 0).any()):
                    raise HFConversionError(
                        f"{fqn} is non-zero (trained with model.moe.load_balance_coeff>0); HF Qwen3-MoE has no "
                        "routing bias, so its expert choices would differ: export needs load_balance_coeff=0")
            elif w is None:
                out[f"{prefix}.gate.weight"] = t.contiguous()
            else:
                for j in range(t.shape[0]):
                    out[f"{prefix}.experts.{j}.{EXPERT_NAMES[w]}.weight"] = t[j].contiguous()
        return out

    def from_hf_state(self, sd: dict[str, torch.Tensor], args: Qwen3MoeArgs) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
        for name, t in sd.items():
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and args.tie_word_embeddings):
                continue
            if m := _HF_EXPERT.match(name):
                layer, j, proj = m.groups()
                experts.setdefault((layer, _HF_PROJ[proj]), {})[int(j)] = t
            elif m := _HF_FUSED.match(name):
                layer, proj = m.groups()
                ours = f"layers.{layer}.feed_forward.experts"
                if proj == "down_proj":
                    out[f"{ours}.w2"] = t
                else:
                    out[f"{ours}.w1"], out[f"{ours}.w3"] = t.chunk(2, dim=1)
            elif m := _HF_GATE.match(name):
                out[f"layers.{m.group(1)}.feed_forward.router.gate.weight"] = t
            else:
                out[from_hf_name(name)] = t
        n = args.moe.num_experts
        for (layer, w), per_expert in sorted(experts.items()):
            if sorted(per_expert) != list(range(n)):
                missing = sorted(set(range(n)) - set(per_expert))
                raise HFConversionError(f"layer {layer}: HF experts {missing[:4]} of {n} missing for {EXPERT_NAMES[w]}")
            out[f"layers.{layer}.feed_forward.experts.{w}"] = torch.stack([per_expert[j] for j in range(n)])
        for i in range(args.n_dense_layers, args.n_layers):  # HF has no routing bias: ours starts at 0
            out[f"layers.{i}.feed_forward.expert_bias"] = torch.zeros(n, dtype=torch.float32)
        if args.tie_word_embeddings and "tok_embeddings.weight" in out:
            out["output.weight"] = out["tok_embeddings.weight"]
        return out

    def hf_config(self, args: Qwen3MoeArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        moe = args.moe
        _check_representable(moe)
        rope = {"rope_type": "default", "rope_theta": float(args.rope_theta)}
        return {**decoder_hf_config(args, architecture="Qwen3MoeForCausalLM", model_type="qwen3_moe",
                                    ffn_dim=args.ffn_hidden_dim, head_dim=args.head_dim, rope=rope, dtype=dtype),
                "use_sliding_window": False,
                "num_experts": moe.num_experts,
                "num_experts_per_tok": moe.top_k,
                "moe_intermediate_size": moe.expert_dim,
                "norm_topk_prob": bool(moe.route_norm),
                "decoder_sparse_step": 1,
                "mlp_only_layers": list(range(args.n_dense_layers)),
                "router_aux_loss_coef": float(moe.aux_loss_coeff),
                "output_router_logits": False}

    def args_from_hf_config(self, cfg: dict[str, Any]) -> Qwen3MoeArgs:
        check_model_type(cfg, "qwen3_moe")
        for key in ("attention_bias", "use_sliding_window"):
            if cfg.get(key):
                raise HFConversionError(f"config.json has {key}=true; Qwen3-MoE here does not support it")
        theta, scaling = rope_theta_of(cfg)
        rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type != "default":
            raise HFConversionError(f"rope type {rope_type!r} is not supported for Qwen3-MoE (default only)")
        n_layers = int(cfg["num_hidden_layers"])
        n_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        step, mlp_only = int(cfg.get("decoder_sparse_step", 1) or 1), set(cfg.get("mlp_only_layers") or [])
        dense = [i for i in range(n_layers) if i in mlp_only or n_experts == 0 or (i + 1) % step]
        if dense != list(range(len(dense))) or len(dense) == n_layers:
            raise HFConversionError(f"config.json makes layers {dense[:8]} dense; only the first k layers may be "
                                    "dense here (decoder_sparse_step=1, mlp_only_layers=[0..k-1], num_experts>0)")
        heads = int(cfg["num_attention_heads"])
        return Qwen3MoeArgs(
            dim=int(cfg["hidden_size"]),
            n_layers=n_layers,
            n_heads=heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            ffn_hidden_dim=int(cfg.get("intermediate_size") or 0),
            n_dense_layers=len(dense),
            vocab_size=int(cfg["vocab_size"]),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_seq_len=int(cfg.get("max_position_embeddings", 40960)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            moe=MoEArgs(num_experts=n_experts, top_k=int(cfg["num_experts_per_tok"]),
                        expert_dim=int(cfg["moe_intermediate_size"]), route_norm=bool(cfg.get("norm_topk_prob")),
                        load_balance_coeff=0.0, aux_loss_coeff=float(cfg.get("router_aux_loss_coef") or 0.0)),
        )
