"""Llama 4 text decoder (Llama-4-Scout-17B-16E, Llama-4-Maverick-17B-128E), parallelism-agnostic.

What differs from Llama 3, each mirroring transformers' ``Llama4ForCausalLM``:

* iRoPE: every ``nope_interval``-th layer (3, 7, 11, ...) has no rotary embedding and attends to
  the whole causal context; the other layers apply rotary (Meta's interleaved pairing, as HF's
  complex-number rotary) and attend only within their ``attention_chunk_size``-token chunk.
* NoPE layers scale each query by ``1 + attn_scale * log1p(floor((pos + 1) / floor_scale))``
  ("temperature tuning": the softmax sharpens slowly with distance).
* QK-norm (``use_qk_norm``, Scout): a weightless RMS normalization of q and k *after* rotary,
  in the rotary layers only.
* MoE layers (every ``moe_interleave_step``-th layer: all of Scout's, every other one of
  Maverick's; the rest are dense SwiGLU of width ``ffn_hidden_dim``): ``common.moe.MoE`` with
  sigmoid top-1 routing, one shared expert, and the gate applied to the expert *input*
  (``score_before_experts``), as Meta's model does.
* Rotary frequency scaling: Llama 3.1's rule with Llama 4's factors (Scout: factor 16, low = high
  frequency factor 1, original context 8192), or none (Maverick).

With ``data.document_mask`` the positions that rotary and the temperature tuning see restart at
every document (HF's training forward counts from the window start; the same when unmasked).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_hydra.models.common.attention import Attention
from titan_hydra.models.common.decoder import Decoder, Multipliers, TransformerBlock, residual_out_std
from titan_hydra.models.common.layers import FeedForward
from titan_hydra.models.common.masking import positions_in_documents
from titan_hydra.models.common.moe import MoE, MoEArgs
from titan_hydra.models.common.rotary import apply_rope, check_rotary_heads, inverse_frequencies, llama3_scaled

ROPE_SCALINGS = ("none", "llama3")


@dataclass(kw_only=True)
class Llama4Args(Multipliers):
    """Llama 4 text-decoder hyper-parameters. Shape fields have no default (each flavor's shape
    lives in conf/model/llama4_*.yaml only); the rest default to Llama-4-Scout's conventions."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None  # None: n_heads (no grouping)
    head_dim: int
    vocab_size: int
    ffn_hidden_dim: int  # dense layers (HF intermediate_size_mlp)
    norm_eps: float = 1e-5
    max_seq_len: int
    rope_theta: float = 500000.0
    rope_scaling: str = "llama3"  # "none" | "llama3"
    rope_factor: float = 16.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 1.0
    rope_original_max_seq_len: int = 8192
    nope_interval: int = 4  # layers i with (i + 1) % nope_interval == 0 have no rotary (0: none)
    nope_layers: list[int] | None = None  # explicit NoPE layer ids instead of the interval
    attention_chunk_size: int | None = 8192  # rotary layers attend within chunks; None: full causal
    use_qk_norm: bool = True
    attn_temperature_tuning: bool = True
    floor_scale: float = 8192.0
    attn_scale: float = 0.1
    moe_interleave_step: int = 1  # layers step-1, 2*step-1, ... are MoE (HF interleave_moe_layer_step)
    moe_layers: list[int] | None = None  # explicit MoE layer ids instead of the step
    moe: MoEArgs | dict
    tie_word_embeddings: bool = False
    depth_init: bool = True

    def __post_init__(self) -> None:
        self.moe = MoEArgs.of(self.moe)
        check_rotary_heads(self.n_heads, self.n_kv_heads, self.head_dim)
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ValueError(f"model.rope_scaling={self.rope_scaling!r} is not one of {', '.join(ROPE_SCALINGS)}")
        if self.attention_chunk_size is not None and self.attention_chunk_size < 1:
            raise ValueError(f"model.attention_chunk_size={self.attention_chunk_size} must be >= 1 (or null)")
        if self.moe_interleave_step < 1 or self.nope_interval < 0 or self.floor_scale <= 0:
            raise ValueError("model.moe_interleave_step must be >= 1, model.nope_interval >= 0 and "
                             "model.floor_scale > 0")
        for key in ("nope_layers", "moe_layers"):
            ids = getattr(self, key)
            if ids is not None:
                ids = sorted({int(i) for i in ids})
                if ids and not 0 <= ids[0] <= ids[-1] < self.n_layers:
                    raise ValueError(f"model.{key}={ids} must hold layer ids in [0, {self.n_layers})")
                setattr(self, key, ids)
        if self.dense_layer_ids and self.ffn_hidden_dim < 1:
            raise ValueError(f"model.ffn_hidden_dim={self.ffn_hidden_dim} must be >= 1 (the dense layers' width)")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def nope_layer_ids(self) -> list[int]:
        if self.nope_layers is not None:
            return list(self.nope_layers)
        k = self.nope_interval
        return [i for i in range(self.n_layers) if k and (i + 1) % k == 0]

    @property
    def moe_layer_ids(self) -> list[int]:
        if self.moe_layers is not None:
            return list(self.moe_layers)
        step = self.moe_interleave_step
        return list(range(step - 1, self.n_layers, step))

    @property
    def dense_layer_ids(self) -> list[int]:
        moe = set(self.moe_layer_ids)
        return [i for i in range(self.n_layers) if i not in moe]


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMS normalization over the last dim, in fp32 (HF ``Llama4TextL2Norm``)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


class Llama4Attention(Attention):
    """``common.attention.Attention`` with Llama 4's per-layer position handling: rotary then
    QK-norm in the rotary (chunked) layers; no rotary and query temperature tuning in the NoPE
    layers. Masking (chunk, documents) is the base class's."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, *, use_rope: bool,
                 qk_norm: bool, norm_eps: float, chunk_size: int | None, temperature: tuple[float, float] | None):
        super().__init__(dim, n_heads, n_kv_heads, head_dim, rope_interleaved=True,
                         chunk_size=chunk_size if use_rope else None)
        self.use_rope = use_rope
        self.l2_qk_norm = qk_norm and use_rope
        self.norm_eps = norm_eps
        self.temperature = None if use_rope else temperature  # (floor_scale, attn_scale)

    def position(self, q, k, cos, sin, doc_ids, offset: int = 0):
        if self.use_rope:
            q, k = apply_rope(q, cos, sin, True), apply_rope(k, cos, sin, True)
            if self.l2_qk_norm:
                q, k = rms_normalize(q, self.norm_eps), rms_normalize(k, self.norm_eps)
        elif self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            if doc_ids is None:
                pos = torch.arange(offset, offset + q.shape[1], device=q.device)[None]
            else:
                pos = positions_in_documents(doc_ids)
            scale = torch.log1p(torch.floor((pos.float() + 1.0) / floor_scale)) * attn_scale + 1.0
            q = (q * scale[:, :, None, None]).to(q.dtype)
        return q, k


class Llama4(Decoder):
    """``Llama4(dim=5120, n_layers=48, moe={...}, ...)``: fields of ``Llama4Args``
    (conf/model/llama4_debug.yaml, llama4_scout.yaml, llama4_maverick.yaml)."""

    def __init__(self, **fields):
        super().__init__(Llama4Args(**fields))

    def make_block(self, layer_id: int) -> TransformerBlock:
        a = self.args
        use_rope = layer_id not in a.nope_layer_ids
        temperature = (float(a.floor_scale), float(a.attn_scale)) if a.attn_temperature_tuning else None
        attention = Llama4Attention(a.dim, a.n_heads, a.kv_heads, a.head_dim, use_rope=use_rope,
                                    qk_norm=a.use_qk_norm, norm_eps=a.norm_eps, chunk_size=a.attention_chunk_size,
                                    temperature=temperature)
        ffn = MoE(a.dim, a.moe) if layer_id in a.moe_layer_ids else FeedForward(a.dim, a.ffn_hidden_dim)
        return TransformerBlock(layer_id, attention, ffn, a.dim, a.norm_eps,
                                residual_out_std(layer_id, a.n_layers, a.depth_init))

    def rope_frequencies(self, device=None) -> torch.Tensor:
        a = self.args
        freqs = inverse_frequencies(a.head_dim, a.rope_theta, device)
        if a.rope_scaling == "llama3":
            freqs = llama3_scaled(freqs, a.rope_factor, a.rope_low_freq_factor, a.rope_high_freq_factor,
                                  a.rope_original_max_seq_len)
        return freqs.float()


__all__ = ["Llama4", "Llama4Args", "Llama4Attention", "rms_normalize"]
