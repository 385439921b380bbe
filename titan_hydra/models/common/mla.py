"""Multi-head latent attention (MLA), the attention of DeepSeek-V2 and V3.

Why it looks like this: MLA caches one small latent per token instead of per-head keys and
values. Keys and values are decompressed from that latent (``wkv_a -> kv_norm -> wkv_b``), and
only a narrow slice of each query/key carries position: rotary runs on ``qk_rope_head_dim``
dims, and the rotated key part is *shared* by all heads (it comes straight out of ``wkv_a``),
while the other ``qk_nope_head_dim`` dims of each head see no rotary at all. Queries come from
one projection (``q_lora_rank == 0``, V2-Lite) or through their own low-rank bottleneck
(``wq_a -> q_norm -> wq_b``, V2/V3). Values may be narrower or wider than query/key heads: SDPA
accepts that, but on CPU only through its math kernel (flash needs one head size), so the
narrower side is zero-padded for the kernel and the output cut back to ``v_head_dim``.

Training runs the decompressed form (full per-head k/v into SDPA): the latent only pays off
for a KV cache at inference. The softmax scale is given by the model (1/sqrt(qk head dim) times
YaRN's mscale^2 when the context was extended), so this module knows nothing of rope scaling.

Like ``attention.Attention``: head counts are read off the projected shapes, so a column-wise
sharded ``wq``/``wkv_b`` would just yield fewer local heads (tensor parallel is still refused
by the DeepSeek-V3 family, which would also have to replicate the shared rope key); the
latent norms use eps 1e-6 whatever the model's norm_eps, as DeepSeek's reference and
transformers do; ``sdpa_dtype`` is the precision policy's knob (``kernels/attention_precision.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_hydra.models.common.layers import RMSNorm, trunc_normal_
from titan_hydra.models.common.masking import visible_keys
from titan_hydra.models.common.rotary import apply_rope, fit_tables

LATENT_NORM_EPS = 1e-6


def _pad_heads(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1]))


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, *, q_lora_rank: int, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, softmax_scale: float, rope_interleaved: bool = True):
        super().__init__()
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.n_heads = n_heads
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.head_dim = qk_nope_head_dim + qk_rope_head_dim  # query/key width per head (precision policy reads it)
        self.softmax_scale = softmax_scale
        self.score_mult = 1.0  # times softmax_scale: muP's attention scaling (the Decoder sets it)
        self.rope_interleaved = rope_interleaved
        self.sdpa_dtype: torch.dtype | None = None  # None = the compute dtype (see attention.Attention)
        # plain causal attention ``(q, k, v, scale=) -> out`` set by the kernel policy
        # (kernels/attention_policy.py); it takes q/k wider than v, so nothing is padded for it
        self.causal_kernel = None
        if q_lora_rank:
            self.wq_a = nn.Linear(dim, q_lora_rank, bias=False)
            self.q_norm = RMSNorm(q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(q_lora_rank, n_heads * self.head_dim, bias=False)
        else:
            self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wkv_a = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.wo = nn.Linear(n_heads * v_head_dim, dim, bias=False)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_lora_rank:
            return self.wq_b(self.q_norm(self.wq_a(x)))
        return self.wq(x)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                doc_ids: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        cos, sin = fit_tables(cos, sin, seqlen)
        q = self.queries(x).view(bsz, seqlen, -1, self.head_dim)
        q_nope, q_rope = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        q_rope = apply_rope(q_rope, cos, sin, self.rope_interleaved)
        k_rope = apply_rope(k_rope.unsqueeze(2), cos, sin, self.rope_interleaved)  # one key head for all
        kv = self.wkv_b(self.kv_norm(latent)).view(bsz, seqlen, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)), dim=-1)
        offset = 0 if cache is None else cache.length
        if cache is not None:  # decoding: keys/values per head, after rotary (not the compressed latent)
            k, v = cache.update(k, v)
        # One width for q/k/v: CPU's flash kernel (and the ring attention of context parallel
        # built on it) needs equal head sizes, else SDPA falls back to the O(S^2)-memory math
        # kernel. Zero columns add nothing to q.k and come out of p.v as zeros, cut off below.
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if not self._kernel_applies(doc_ids, offset):  # the policy's kernel takes unequal widths
            width = max(self.head_dim, self.v_head_dim)
            q, k, v = (_pad_heads(t, width) for t in (q, k, v))
        out = self._sdpa(q, k, v, doc_ids, offset)[..., : self.v_head_dim]
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              doc_ids: torch.Tensor | None = None, offset: int = 0) -> torch.Tensor:
        dtype = self.sdpa_dtype
        if dtype is None:
            return self._attend(q, k, v, doc_ids, offset)
        with torch.autocast(q.device.type, enabled=False):  # autocast would cast fp32 q/k/v down again
            out = self._attend(q.to(dtype), k.to(dtype), v.to(dtype), doc_ids, offset)
        return out.to(v.dtype)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None,
                offset: int = 0) -> torch.Tensor:
        scale = self.softmax_scale * self.score_mult
        if self._kernel_applies(doc_ids, offset):
            return self.causal_kernel(q, k, v, scale=scale)
        if doc_ids is None and offset == 0:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        mask = visible_keys(q.shape[2], device=q.device, doc_ids=doc_ids, q_offset=offset, kv_len=k.shape[2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

    def _kernel_applies(self, doc_ids: torch.Tensor | None, offset: int) -> bool:
        return self.causal_kernel is not None and doc_ids is None and offset == 0

    def init_weights(self, out_std: float, in_std: float = 0.02) -> None:
        queries = (self.wq_a, self.wq_b) if self.q_lora_rank else (self.wq,)
        for w in (*queries, self.wkv_a, self.wkv_b):
            trunc_normal_(w.weight, in_std)
        trunc_normal_(self.wo.weight, out_std)
        self.kv_norm.reset_parameters()
        if self.q_lora_rank:
            self.q_norm.reset_parameters()
