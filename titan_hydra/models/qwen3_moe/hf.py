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

from typing import Any

import torch

from titan_hydra.models.common.hf_decoder import (
    DecoderHFAdapter, ExpertLayout, HFConversionError, check_model_type, decoder_args_of, decoder_hf_config,
    refuse_other_routing, rope_of,
)
from titan_hydra.models.common.moe import MoEArgs
from titan_hydra.models.qwen3_moe.model import Qwen3MoeArgs


class Qwen3MoeHFAdapter(DecoderHFAdapter):
    model_type = "qwen3_moe"
    extra_names = {"feed_forward.router.gate.weight": "mlp.gate.weight"}
    experts = ExpertLayout(module="mlp", per_expert=True)
    no_routing_bias = "HF Qwen3-MoE has no routing bias"

    def check_export(self, args: Qwen3MoeArgs) -> None:
        refuse_other_routing(args.moe, "HF Qwen3-MoE routes by softmax top-k only", score_func="softmax",
                             num_shared_experts=0)

    def hf_config(self, args: Qwen3MoeArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        self.check_export(args)
        moe = args.moe
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
        theta, _, _ = rope_of(cfg, ("default",), "Qwen3-MoE")
        n_layers = int(cfg["num_hidden_layers"])
        n_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        step, mlp_only = int(cfg.get("decoder_sparse_step", 1) or 1), set(cfg.get("mlp_only_layers") or [])
        dense = [i for i in range(n_layers) if i in mlp_only or n_experts == 0 or (i + 1) % step]
        if dense != list(range(len(dense))) or len(dense) == n_layers:
            raise HFConversionError(f"config.json makes layers {dense[:8]} dense; only the first k layers may be "
                                    "dense here (decoder_sparse_step=1, mlp_only_layers=[0..k-1], num_experts>0)")
        return Qwen3MoeArgs(
            **decoder_args_of(cfg, norm_eps=1e-6, max_seq_len=40960),
            ffn_hidden_dim=int(cfg.get("intermediate_size") or 0),
            n_dense_layers=len(dense),
            rope_theta=theta,
            moe=MoEArgs(num_experts=n_experts, top_k=int(cfg["num_experts_per_tok"]),
                        expert_dim=int(cfg["moe_intermediate_size"]), route_norm=bool(cfg.get("norm_topk_prob")),
                        load_balance_coeff=0.0, aux_loss_coeff=float(cfg.get("router_aux_loss_coef") or 0.0)),
        )
