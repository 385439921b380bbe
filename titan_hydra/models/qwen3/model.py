"""Qwen3 dense decoder, parallelism-agnostic.

What differs from Llama: RMSNorm over each head's query and key before rotary (QK-norm),
``head_dim`` set on its own (0.6B: 16 heads x 128 on a 1024-wide model, so q is 2048 wide),
the FFN width given directly, HF's half-split rotary pairing (weights convert without any
permutation), rope theta 1e6, and tied input/output embeddings in the 0.6B-4B releases.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from titan_hydra.models.common.attention import Attention
from titan_hydra.models.common.decoder import Decoder, Multipliers, TransformerBlock, residual_out_std
from titan_hydra.models.common.layers import FeedForward
from titan_hydra.models.common.rotary import inverse_frequencies


@dataclass(kw_only=True)
class Qwen3Args(Multipliers):
    """Qwen3 hyper-parameters (HF field meanings). Shape fields have no default: each flavor's shape
    lives in conf/model/qwen3_*.yaml only."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None  # None: n_heads (no grouping)
    head_dim: int
    ffn_hidden_dim: int
    vocab_size: int
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_seq_len: int
    qk_norm: bool = True
    tie_word_embeddings: bool = False
    depth_init: bool = True

    def __post_init__(self) -> None:
        if self.n_heads % self.kv_heads:
            raise ValueError(f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"model.head_dim={self.head_dim} must be even for rotary embeddings")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads


class Qwen3(Decoder):
    """``Qwen3(dim=1024, n_layers=28, head_dim=128, ...)``: fields of ``Qwen3Args`` (conf/model/qwen3_*.yaml)."""

    args_cls: type = Qwen3Args  # what the fields build (Qwen3-MoE: its own, a Qwen3Args subclass)

    def __init__(self, **fields):
        super().__init__(self.args_cls(**fields))

    def make_block(self, layer_id: int) -> TransformerBlock:
        a = self.args
        attention = Attention(a.dim, a.n_heads, a.kv_heads, a.head_dim, qk_norm=a.qk_norm, norm_eps=a.norm_eps,
                              rope_interleaved=False)
        return TransformerBlock(layer_id, attention, self.make_ffn(layer_id), a.dim, a.norm_eps,
                                residual_out_std(layer_id, a.n_layers, a.depth_init))

    def make_ffn(self, layer_id: int) -> nn.Module:
        """Layer ``layer_id``'s feed-forward: the one part of a block Qwen3-MoE changes."""
        return FeedForward(self.args.dim, self.args.ffn_hidden_dim)

    def rope_frequencies(self, device=None) -> torch.Tensor:
        return inverse_frequencies(self.args.head_dim, self.args.rope_theta, device).float()
