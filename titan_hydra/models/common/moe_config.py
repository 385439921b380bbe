"""Config schema of the nested ``model.moe`` node that every MoE family's schema embeds.

Types and conventions only: the expert count, top-k and expert width are shapes and live in each
flavor's yaml (so they are MISSING here); the routing and balancing conventions have the
defaults of ``moe.MoEArgs``. Families turn the node (a dict after Hydra) into ``MoEArgs``.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING


@dataclass
class MoEConfig:
    num_experts: int = MISSING
    top_k: int = MISSING
    expert_dim: int = MISSING  # hidden width of one routed expert (HF moe_intermediate_size)
    num_shared_experts: int = 0  # shared FFN width = num_shared_experts * expert_dim
    score_func: str = "softmax"  # softmax | sigmoid (fp32)
    route_norm: bool = False  # renormalize the k gates to sum 1 (HF norm_topk_prob)
    route_scale: float = 1.0  # HF routed_scaling_factor
    num_expert_groups: int = 1  # HF n_group (1 = no group-limited routing)
    num_limited_groups: int = 1  # HF topk_group
    load_balance_coeff: float = 1e-3  # aux-loss-free bias update rate per step; 0 = off
    aux_loss_coeff: float = 0.0  # sequence-wise auxiliary balance loss weight; 0 = off
    use_grouped_mm: bool = True  # False: one matmul per expert (baseline / fallback)
    score_before_experts: bool = False  # gate the expert input, not its output (Llama 4)
