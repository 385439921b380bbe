"""Qwen3.5-MoE decoder (text model): Qwen3.5's hybrid layers with every FFN a mixture of experts.

The experts are ``common.moe.MoE``'s (softmax over all experts, top-k, gates renormalized to
sum 1) plus one shared expert whose output is scaled per token by sigmoid(shared_gate(x)), as
transformers' ``Qwen3_5MoeSparseMoeBlock`` does (``GatedSharedExpert``). The shared expert's
width is ``moe.num_shared_experts x moe.expert_dim`` (the released models: 1 x expert width).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from titan_hydra.models.common.layers import FeedForward, trunc_normal_
from titan_hydra.models.common.moe import MoE, MoEArgs
from titan_hydra.models.qwen3_5.model import HybridDecoder, Qwen35Args


@dataclass(kw_only=True)
class Qwen35MoeArgs(Qwen35Args):
    """Qwen3.5's fields plus the experts. ``ffn_hidden_dim`` builds nothing (every layer is MoE); it
    only carries HF's ``intermediate_size`` through a conversion (Qwen3-Next's config sets one)."""

    ffn_hidden_dim: int = 0
    moe: MoEArgs | dict

    def __post_init__(self) -> None:
        super().__post_init__()
        self.moe = MoEArgs.of(self.moe)


class GatedSharedExpert(FeedForward):
    """SwiGLU whose output is scaled per token by sigmoid(gate(x)) (HF ``shared_expert_gate``)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__(dim, hidden_dim)
        self.gate = nn.Linear(dim, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.gate(x)) * super().forward(x)

    def init_weights(self, out_std: float, in_std: float = 0.02) -> None:
        super().init_weights(out_std, in_std)
        trunc_normal_(self.gate.weight, in_std)


class SharedGatedMoE(MoE):
    """``common.moe.MoE`` with its shared expert gated (``GatedSharedExpert``)."""

    def __init__(self, dim: int, args: MoEArgs | dict[str, Any]):
        super().__init__(dim, args)
        if self.shared_experts is not None:
            self.shared_experts = GatedSharedExpert(dim, self.args.shared_dim)


class Qwen35Moe(HybridDecoder):
    """``Qwen35Moe(dim=2048, n_layers=40, moe={...}, ...)``: fields of ``Qwen35MoeArgs``
    (conf/model/qwen3_5_moe_debug.yaml, qwen3_5_35b_a3b.yaml, ...)."""

    def __init__(self, **fields):
        super().__init__(Qwen35MoeArgs(**fields))

    def make_feed_forward(self, layer_id: int) -> nn.Module:
        return SharedGatedMoE(self.args.dim, self.args.moe)
