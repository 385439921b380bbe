"""Causal grouped-query attention via SDPA, with the options the dense families need.

* ``head_dim`` is its own field (Qwen3: 16 heads x 128 on a 1024-wide model), not dim/n_heads.
* ``qk_norm``: RMSNorm over each head's query and key before rotary (Qwen3).
* ``rope_interleaved``: which rotary pairing the weights were trained with (see rotary.py).

Head counts are read off the projected shapes at runtime, so a column-wise sharded
``wq/wk/wv`` (tensor parallel) just yields fewer local heads: the module needs no TP knowledge.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_hydra.models.common.layers import RMSNorm, trunc_normal_
from titan_hydra.models.common.rotary import apply_rope


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, *, qk_norm: bool = False,
                 norm_eps: float = 1e-6, rope_interleaved: bool = True, bias: bool = False):
        super().__init__()
        self.head_dim = head_dim
        self.rope_interleaved = rope_interleaved
        # dtype SDPA runs in; None = whatever q/k/v arrive in (the compute dtype). A training
        # precision policy may set float32 (titan_hydra.train.precision).
        self.sdpa_dtype: torch.dtype | None = None
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.q_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        if self.q_norm is not None:
            # The norms' fp32 weights would promote autocast's bf16 q/k to fp32; keep the
            # projections' dtype (HF's Qwen3RMSNorm returns its input dtype too).
            q, k = self.q_norm(q).type_as(q), self.k_norm(k).type_as(k)
        # The tables arrive whole: only here is the true sequence length known (a pipeline
        # stage's input may be sequence-sharded by TP and gathered just before attention).
        cos, sin = cos[:seqlen], sin[:seqlen]
        q = apply_rope(q, cos, sin, self.rope_interleaved)
        k = apply_rope(k, cos, sin, self.rope_interleaved)
        n_rep = q.shape[2] // k.shape[2]
        if n_rep > 1:  # kv head j serves query heads j*n_rep .. (j+1)*n_rep-1, as in Meta's repeat_kv
            k = k.repeat_interleave(n_rep, dim=2)
            v = v.repeat_interleave(n_rep, dim=2)
        out = self._sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dtype = self.sdpa_dtype
        if dtype is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        # Even when q/k/v already arrive in ``dtype``, an active autocast would cast them down
        # again inside SDPA (it is on autocast's lower-precision list): always run it disabled.
        with torch.autocast(q.device.type, enabled=False):
            out = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), is_causal=True)
        return out.to(v.dtype)

    def init_weights(self, out_std: float, in_std: float = 0.02) -> None:
        for w in (self.wq, self.wk, self.wv):
            trunc_normal_(w.weight, in_std)
            if w.bias is not None:
                nn.init.zeros_(w.bias)
        trunc_normal_(self.wo.weight, out_std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()
