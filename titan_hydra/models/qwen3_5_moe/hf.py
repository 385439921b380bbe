"""Our Qwen3.5-MoE <-> Hugging Face ``Qwen3_5MoeForCausalLM`` (``model_type: qwen3_5_moe_text``).

Token mixers and norms as in ``qwen3_5/hf.py``. Each MoE layer: the router ``mlp.gate.weight``
[E, dim]; the experts fused, ``mlp.experts.gate_up_proj`` [E, 2 x hidden, dim] (gate rows first)
and ``down_proj`` [E, dim, hidden], against our stacked ``w1`` / ``w3`` / ``w2``; the shared
expert ``mlp.shared_expert.*_proj`` and its gate ``mlp.shared_expert_gate.weight`` [1, dim].
transformers writes the experts one tensor per expert and projection on disk
(``mlp.experts.<j>.gate_proj.weight``, ...), which is what export writes; import reads both.

HF routes by softmax top-k with renormalized gates, one gated shared expert and no
selection-only bias: a model whose routing differs, or whose ``expert_bias`` moved, is refused
with one line.
"""

from __future__ import annotations

from typing import Any

import torch

from titan_hydra.models.common.hf_decoder import ExpertLayout, HFConversionError, ffn_names, refuse_other_routing
from titan_hydra.models.common.moe import MoEArgs
from titan_hydra.models.qwen3_5.hf import (
    LINEAR_NAMES, HybridHFAdapter, hybrid_args_of, hybrid_hf_config, refuse_attention_multiplier,
)
from titan_hydra.models.qwen3_5_moe.model import Qwen35MoeArgs


class Qwen35MoeHFAdapter(HybridHFAdapter):
    model_type = "qwen3_5_moe_text"
    extra_names = {
        **LINEAR_NAMES,
        "feed_forward.router.gate.weight": "mlp.gate.weight",
        **ffn_names("feed_forward.shared_experts", "mlp.shared_expert"),
        "feed_forward.shared_experts.gate.weight": "mlp.shared_expert_gate.weight",
    }
    experts = ExpertLayout(module="mlp", per_expert=True)
    no_routing_bias = "HF Qwen3.5-MoE has no routing bias"

    def check_export(self, args: Qwen35MoeArgs) -> None:
        refuse_attention_multiplier(args)
        refuse_other_routing(args.moe, "HF Qwen3.5-MoE routes by softmax top-k with renormalized gates and one "
                             "gated shared expert", score_func="softmax", route_norm=True,
                             num_shared_experts=lambda n: n >= 1, score_before_experts=False)

    def hf_config(self, args: Qwen35MoeArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        self.check_export(args)
        moe = args.moe
        cfg = hybrid_hf_config(args, architecture="Qwen3_5MoeForCausalLM", model_type=self.model_type, dtype=dtype)
        return {**cfg, "num_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
                "moe_intermediate_size": moe.expert_dim, "shared_expert_intermediate_size": moe.shared_dim,
                "router_aux_loss_coef": float(moe.aux_loss_coeff), "output_router_logits": False}

    def args_from_hf_config(self, cfg: dict[str, Any]) -> Qwen35MoeArgs:
        fields = hybrid_args_of(cfg, self.model_type, "Qwen3.5-MoE")
        expert, shared = int(cfg.get("moe_intermediate_size", 512)), int(cfg.get("shared_expert_intermediate_size", 512))
        if shared < expert or shared % expert:
            raise HFConversionError(f"config.json has shared_expert_intermediate_size={shared}, not a multiple of "
                                    f"moe_intermediate_size={expert}; the shared expert here is k experts wide")
        return Qwen35MoeArgs(**fields, ffn_hidden_dim=int(cfg.get("intermediate_size") or 0), moe=MoEArgs(
            num_experts=int(cfg.get("num_experts", 256)), top_k=int(cfg.get("num_experts_per_tok", 8)),
            expert_dim=expert, num_shared_experts=shared // expert, route_norm=True, load_balance_coeff=0.0,
            aux_loss_coeff=float(cfg.get("router_aux_loss_coef", 0.001))))
