"""Llama 2 / 3 (Meta's reference architecture), parallelism-agnostic.

A ``Decoder`` with GQA attention in Meta's interleaved rotary layout, SwiGLU sized by Meta's
``multiple_of`` / ``ffn_dim_multiplier`` rule, optional Llama 3.1 rope scaling, and optional
tied embeddings (the Llama 3.2 1B/3B releases tie them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_hydra.models.common.attention import Attention
from titan_hydra.models.common.decoder import Decoder, Multipliers, TransformerBlock, residual_out_std
from titan_hydra.models.common.layers import FeedForward
from titan_hydra.models.common.rotary import inverse_frequencies, llama3_scaled


@dataclass(kw_only=True)
class LlamaArgs(Multipliers):
    """Shape and init hyper-parameters of a Llama model (Meta's field names). The shape fields
    have no default: a flavor's shape lives in its conf/model/*.yaml only, so code and config
    cannot drift apart."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None  # None -> n_heads (multi-head attention)
    vocab_size: int
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: bool = False  # Llama 3.1/3.2 low-frequency rope scaling
    rope_scaling_factor: float = 8.0  # 8 for Llama 3.1, 32 for Llama 3.2
    max_seq_len: int
    depth_init: bool = True  # scale output-projection init std by layer depth
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head dim {self.head_dim} must be even for rotary embeddings")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU hidden size exactly as Meta computes it (2/3 of 4*dim, scaled, rounded up)."""
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


def rope_frequencies(args: LlamaArgs, device=None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] in fp32, with Llama 3.1 scaling if enabled."""
    freqs = inverse_frequencies(args.head_dim, args.rope_theta, device)
    if args.rope_scaling:
        freqs = llama3_scaled(freqs, args.rope_scaling_factor)
    return freqs.float()


class Llama3(Decoder):
    """``Llama3(dim=4096, n_layers=32, ...)``: fields of ``LlamaArgs`` (conf/model/llama*.yaml)."""

    def __init__(self, **fields):
        super().__init__(LlamaArgs(**fields))

    def make_block(self, layer_id: int) -> TransformerBlock:
        a = self.args
        attention = Attention(a.dim, a.n_heads, a.kv_heads, a.head_dim, rope_interleaved=True)
        return TransformerBlock(layer_id, attention, FeedForward(a.dim, a.ffn_hidden_dim), a.dim, a.norm_eps,
                                residual_out_std(layer_id, a.n_layers, a.depth_init))

    def rope_frequencies(self, device=None) -> torch.Tensor:
        return rope_frequencies(self.args, device)
