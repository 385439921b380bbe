"""Qwen3.5 dense decoder (text model): Gated DeltaNet layers interleaved with gated full attention.

What differs from Qwen3, each as transformers' ``Qwen3_5ForCausalLM`` computes it:

* ``layer_types``: each layer mixes tokens either with a Gated DeltaNet (``linear_attention``,
  ``common/gated_deltanet.py``, the block's ``linear_attn``) or with full causal attention
  (``full_attention``, the block's ``attention``). ``layer_pattern.py`` turns the config into the list.
* Gated attention: ``wq`` projects each head's query and an output gate side by side
  ([H, 2 x head_dim], so a column shard keeps whole heads); the attention output is multiplied by
  sigmoid(gate) before ``wo``.
* Partial rotary: only the first ``partial_rotary_factor`` x head_dim channels of q/k rotate
  (half-split pairing); the rest pass unchanged.
* Every RMSNorm outside the DeltaNet scales by (1 + w) with w starting at 0 (``OffsetRMSNorm``);
  HF stores the same w, so weights convert unchanged. The DeltaNet's gated norm scales by w.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titan_hydra.models.common.attention import Attention
from titan_hydra.models.common.decoder import Decoder, Multipliers, residual_out_std
from titan_hydra.models.common.gated_deltanet import GatedDeltaNet
from titan_hydra.models.common.layers import FeedForward
from titan_hydra.models.common.rotary import apply_rope, inverse_frequencies
from titan_hydra.models.qwen3_5.layer_pattern import FULL, LINEAR, resolve_layer_types


@dataclass(kw_only=True)
class Qwen35Args(Multipliers):
    """Qwen3.5 hyper-parameters (HF field meanings in comments). Shape fields have no default: each
    flavor's shape lives in conf/model/qwen3_5_*.yaml only."""

    dim: int
    n_layers: int
    n_heads: int  # full-attention query heads
    n_kv_heads: int | None = None  # None: n_heads (no grouping)
    head_dim: int
    ffn_hidden_dim: int
    vocab_size: int
    norm_eps: float = 1e-6
    rope_theta: float = 10000000.0
    partial_rotary_factor: float = 0.25  # share of head_dim that rotates
    max_seq_len: int
    tie_word_embeddings: bool = False
    depth_init: bool = True
    # Which layers are full attention: an explicit list of layer types, or every k-th layer
    # (HF full_attention_interval; 4 = 3 linear : 1 full, 1 = all full, 0 = all linear).
    layer_types: list[str] | None = None
    full_attention_interval: int = 4
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    linear_chunk_size: int = 64  # tokens per chunk of the DeltaNet's chunked (training) form

    def __post_init__(self) -> None:
        if self.n_heads % self.kv_heads:
            raise ValueError(f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.kv_heads}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"model.linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                             f"model.linear_num_key_heads={self.linear_num_key_heads}")
        if self.rotary_dim < 2 or self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(f"model.partial_rotary_factor={self.partial_rotary_factor} x head_dim={self.head_dim} "
                             "must give an even rotary width between 2 and head_dim")
        self.layer_kinds  # validates the pattern now: a bad one is a config error, not a build error

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def layer_kinds(self) -> list[str]:
        """The type of every layer (``layer_types`` if set, else from ``full_attention_interval``)."""
        return resolve_layer_types(self.n_layers, self.layer_types, self.full_attention_interval)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)  # HF truncates the same way


class OffsetRMSNorm(nn.Module):
    """RMSNorm scaled by (1 + weight), weight starting at 0, all in fp32 (HF's Qwen3NextRMSNorm)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * (1.0 + self.weight.float())).type_as(x)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)


class GatedAttention(Attention):
    """Causal GQA with QK-norm (offset), partial half-split rotary and a sigmoid output gate per channel."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, rotary_dim: int, norm_eps: float):
        super().__init__(dim, n_heads, n_kv_heads, head_dim, rope_interleaved=False)
        self.rotary_dim = rotary_dim
        self.wq = nn.Linear(dim, n_heads * head_dim * 2, bias=False)  # per head: [query | gate]
        self.q_norm = OffsetRMSNorm(head_dim, norm_eps)
        self.k_norm = OffsetRMSNorm(head_dim, norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                doc_ids: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q, gate = self.wq(x).view(bsz, seqlen, -1, 2 * self.head_dim).chunk(2, dim=-1)
        out = self.attend(q, x, cos, sin, doc_ids, cache)
        return self.wo(out * torch.sigmoid(gate.reshape(bsz, seqlen, -1)))

    def position(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 doc_ids: torch.Tensor | None, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = self.q_norm(q), self.k_norm(k)
        r = self.rotary_dim
        return tuple(torch.cat([apply_rope(t[..., :r], cos, sin, interleaved=False), t[..., r:]], dim=-1)
                     for t in (q, k))


class HybridBlock(nn.Module):
    """Pre-norm block whose token mixer is ``attention`` (full) or ``linear_attn`` (Gated DeltaNet):
    h = x + mix(norm(x)); out = h + ffn(norm(h))."""

    def __init__(self, layer_id: int, layer_type: str, mixer: nn.Module, feed_forward: nn.Module, dim: int,
                 norm_eps: float, out_std: float):
        super().__init__()
        self.layer_id, self.layer_type, self.out_std = layer_id, layer_type, out_std
        if layer_type == LINEAR:
            self.linear_attn = mixer
        else:
            self.attention = mixer
        self.feed_forward = feed_forward
        self.attention_norm = OffsetRMSNorm(dim, norm_eps)
        self.ffn_norm = OffsetRMSNorm(dim, norm_eps)
        self.residual_mult = 1.0  # CompleteP's branch multiplier (the Decoder sets it from its args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                doc_ids: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        normed = self.attention_norm(x)
        if self.layer_type == FULL:
            extra = {k: v for k, v in (("doc_ids", doc_ids), ("cache", cache)) if v is not None}
            mixed = self.attention(normed, cos, sin, **extra)
        elif cache is None:
            mixed = self.linear_attn(normed, document_ids=doc_ids)
        else:  # decoding: the chunked form for a prompt, the recurrent one token by token
            run = self.linear_attn.step if cache.state is not None and x.shape[1] == 1 else self.linear_attn.prefill
            mixed, cache.state = run(normed, cache.state)
        if self.residual_mult != 1.0:
            mixed = mixed * self.residual_mult
        h = x + mixed
        out = self.feed_forward(self.ffn_norm(h))
        return h + (out if self.residual_mult == 1.0 else out * self.residual_mult)

    def init_weights(self) -> None:
        mixer = self.attention if self.layer_type == FULL else self.linear_attn
        mixer.init_weights(self.out_std)
        self.feed_forward.init_weights(self.out_std)
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()


class HybridDecoder(Decoder):
    """The Decoder shell with Qwen3.5's token mixers, offset final norm and partial rotary tables;
    ``make_feed_forward`` is the dense/MoE difference."""

    def __init__(self, args) -> None:
        super().__init__(args)
        self.norm = OffsetRMSNorm(args.dim, args.norm_eps)

    def make_feed_forward(self, layer_id: int) -> nn.Module:
        return FeedForward(self.args.dim, self.args.ffn_hidden_dim)

    def make_block(self, layer_id: int) -> HybridBlock:
        a = self.args
        kind = a.layer_kinds[layer_id]
        if kind == LINEAR:
            mixer = GatedDeltaNet(a.dim, a.linear_num_key_heads, a.linear_num_value_heads, a.linear_key_head_dim,
                                  a.linear_value_head_dim, conv_width=a.linear_conv_kernel_dim, norm_eps=a.norm_eps,
                                  chunk_size=a.linear_chunk_size)
        else:
            mixer = GatedAttention(a.dim, a.n_heads, a.kv_heads, a.head_dim, a.rotary_dim, a.norm_eps)
        return HybridBlock(layer_id, kind, mixer, self.make_feed_forward(layer_id), a.dim, a.norm_eps,
                           residual_out_std(layer_id, a.n_layers, a.depth_init))

    def rope_frequencies(self, device=None) -> torch.Tensor:
        return inverse_frequencies(self.args.rotary_dim, self.args.rope_theta, device).float()


class Qwen35(HybridDecoder):
    """``Qwen35(dim=4096, n_layers=32, layer_types=[...], ...)``: fields of ``Qwen35Args``
    (conf/model/qwen3_5_*.yaml)."""

    def __init__(self, **fields):
        super().__init__(Qwen35Args(**fields))
