"""Qwen3-MoE decoder (Qwen3-30B-A3B, Qwen3-235B-A22B), parallelism-agnostic.

Qwen3's attention unchanged (QK-norm, ``head_dim`` set on its own, HF's half-split rotary), and
in place of the dense FFN a ``common.moe.MoE``: softmax routing over all experts, top-k, gates
renormalized to sum 1 (HF ``norm_topk_prob``), no shared experts. The first ``n_dense_layers``
layers may keep a dense SwiGLU of width ``ffn_hidden_dim`` (HF ``mlp_only_layers``); the
released models have none.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from titan_hydra.models.common.layers import FeedForward
from titan_hydra.models.common.moe import MoE, MoEArgs
from titan_hydra.models.qwen3.model import Qwen3, Qwen3Args


@dataclass(kw_only=True)
class Qwen3MoeArgs(Qwen3Args):
    """Qwen3's fields plus the experts and the dense-layer count (``ffn_hidden_dim`` is the width of
    the dense layers only, HF intermediate_size). No shape has a default, as in Qwen3Args."""

    n_dense_layers: int = 0  # the first k layers are dense (HF mlp_only_layers = [0..k-1])
    moe: MoEArgs | dict

    def __post_init__(self) -> None:
        super().__post_init__()
        self.moe = MoEArgs.of(self.moe)
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ValueError(f"model.n_dense_layers={self.n_dense_layers} must be between 0 and "
                             f"model.n_layers={self.n_layers}")
        if self.n_dense_layers and self.ffn_hidden_dim < 1:
            raise ValueError(f"model.n_dense_layers={self.n_dense_layers} needs model.ffn_hidden_dim >= 1")


class Qwen3Moe(Qwen3):
    """``Qwen3Moe(dim=2048, n_layers=48, moe={...}, ...)``: fields of ``Qwen3MoeArgs``
    (conf/model/qwen3_moe_debug.yaml, qwen3_30b_a3b.yaml, qwen3_235b_a22b.yaml). Qwen3's blocks
    and rotary; experts in place of the dense FFN past the first ``n_dense_layers``."""

    args_cls = Qwen3MoeArgs

    def make_ffn(self, layer_id: int) -> nn.Module:
        a = self.args
        return FeedForward(a.dim, a.ffn_hidden_dim) if layer_id < a.n_dense_layers else MoE(a.dim, a.moe)
