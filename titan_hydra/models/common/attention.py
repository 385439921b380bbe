"""Causal grouped-query attention via SDPA, with the options the decoder families need.

* ``head_dim`` is its own field (Qwen3: 16 heads x 128 on a 1024-wide model), not dim/n_heads.
* ``qk_norm``: RMSNorm over each head's query and key before rotary (Qwen3).
* ``rope_interleaved``: which rotary pairing the weights were trained with (see rotary.py).
* ``bias`` / ``out_bias``: biases on the q/k/v and on the output projection (GPT-OSS has both).
* ``sliding_window=W``: each query sees only the last W positions (itself included), as HF's
  ``sliding_window`` (key j visible from query i iff i - W < j <= i).
* ``sinks``: a learned logit per head that joins every softmax row and whose probability mass
  is then dropped (GPT-OSS "attention sinks"): a row may put weight on "nothing".
* ``chunk_size=C``: each query sees only keys of its own C-token chunk (Llama 4's local layers).
* ``doc_ids`` (forward argument, ``data.document_mask=true``): queries see only their own
  document's keys; the cos/sin tables then arrive per token [B, S, D/2] (positions restart per
  document, see ``masking.py``).

The default (no window, chunk, sinks or documents) stays one ``is_causal`` SDPA call, or whatever
``causal_kernel`` names instead (a callable ``(q, k, v) -> out`` for plain causal attention that a
training policy may install from outside, e.g. ``titan_hydra.kernels.attention_policy``). The others
need an explicit mask (``masking.visible_keys``), which torch 2.13's CPU flex_attention cannot differentiate through, so
they run as SDPA with a boolean mask. The sink is made exact inside that one SDPA call: every
head gets one extra key, visible from every query, whose value is 0 and whose score is the sink
logit (the head dim is padded so that q . k_sink = sink / scale, with q's pad = 1 and the real
keys' pad = 0). The softmax then normalizes over keys + sink and the sink contributes nothing
to the output, which is exactly HF's concat-softmax-drop; gradients reach the sink through the
extra key (in bf16 the sink logit carries bf16 rounding, like every other score). The mask is
O(S^2) booleans per call (64 MiB at 8k tokens): fine at the lengths trained here, but very
long contexts on GPU would want a block-sparse mask (flex_attention) instead.

Head counts are read off the projected shapes at runtime, so a column-wise sharded
``wq/wk/wv`` (tensor parallel) just yields fewer local heads: the module needs no TP knowledge.
The per-head ``sinks`` would have to be sharded with the heads: a family with sinks refuses TP.
Context parallel's attention handlers only know ``is_causal``: a family with a window or sinks
refuses CP (see the family's ``check``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_hydra.models.common.layers import RMSNorm, trunc_normal_
from titan_hydra.models.common.masking import visible_keys
from titan_hydra.models.common.rotary import apply_rope, fit_tables


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, *, qk_norm: bool = False,
                 norm_eps: float = 1e-6, rope_interleaved: bool = True, bias: bool = False,
                 out_bias: bool = False, sliding_window: int | None = None, sinks: bool = False,
                 chunk_size: int | None = None):
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window={sliding_window} must be >= 1 (or None for full causal attention)")
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size} must be >= 1 (or None for full causal attention)")
        self.head_dim = head_dim
        self.sliding_window = sliding_window
        self.chunk_size = chunk_size
        self.rope_interleaved = rope_interleaved
        # dtype SDPA runs in; None = whatever q/k/v arrive in (the compute dtype). A training
        # precision policy may set float32 (titan_hydra.kernels.attention_precision).
        self.sdpa_dtype: torch.dtype | None = None
        # replacement for the plain causal SDPA call (None = SDPA), installed by a training policy
        self.causal_kernel = None
        # scores = score_mult * q.k / sqrt(head_dim): muP's 1/head_dim scaling (the Decoder sets it)
        self.score_mult = 1.0
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=out_bias)
        self.sinks = nn.Parameter(torch.empty(n_heads)) if sinks else None
        self.q_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                doc_ids: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        return self.wo(self.attend(q, x, cos, sin, doc_ids, cache))

    def attend(self, q: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               doc_ids: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """Projected queries q [B, S, H, D] and the input x -> attention output [B, S, H * D] before
        ``wo`` (a variant that projects q its own way, or gates the output, calls this)."""
        bsz, seqlen, _ = x.shape
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        # The tables arrive whole: only here is the true sequence length known (a pipeline
        # stage's input may be sequence-sharded by TP and gathered just before attention).
        # With a KV cache (decoding) they arrive starting at the cache's position.
        offset = 0 if cache is None else cache.length
        q, k = self.position(q, k, *fit_tables(cos, sin, seqlen), doc_ids, offset)
        if self.score_mult != 1.0:  # on q: every kernel below keeps its own 1/sqrt(head_dim)
            q = q * self.score_mult
        if cache is not None:
            k, v = cache.update(k, v)
        n_rep = q.shape[2] // k.shape[2]
        if n_rep > 1:  # kv head j serves query heads j*n_rep .. (j+1)*n_rep-1, as in Meta's repeat_kv
            k = k.repeat_interleave(n_rep, dim=2)
            v = v.repeat_interleave(n_rep, dim=2)
        out = self._sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), doc_ids, offset)
        return out.transpose(1, 2).reshape(bsz, seqlen, -1)

    def position(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 doc_ids: torch.Tensor | None, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, S, H, D], k [B, S, Hkv, D] before attention: QK-norm, then rotary (a family with
        another order or NoPE layers overrides this). ``offset``: position of the first token
        (> 0 when decoding with a KV cache; the tables already start there)."""
        if self.q_norm is not None:
            # The norms' fp32 weights would promote autocast's bf16 q/k to fp32; keep the
            # projections' dtype (HF's Qwen3RMSNorm returns its input dtype too).
            q, k = self.q_norm(q).type_as(q), self.k_norm(k).type_as(k)
        return apply_rope(q, cos, sin, self.rope_interleaved), apply_rope(k, cos, sin, self.rope_interleaved)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              doc_ids: torch.Tensor | None = None, offset: int = 0) -> torch.Tensor:
        dtype = self.sdpa_dtype
        if dtype is None:
            return self._attend(q, k, v, doc_ids, offset)
        # Even when q/k/v already arrive in ``dtype``, an active autocast would cast them down
        # again inside SDPA (it is on autocast's lower-precision list): always run it disabled.
        with torch.autocast(q.device.type, enabled=False):
            out = self._attend(q.to(dtype), k.to(dtype), v.to(dtype), doc_ids, offset)
        return out.to(v.dtype)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None,
                offset: int = 0) -> torch.Tensor:
        s, t = q.shape[2], k.shape[2]
        # a window or chunk at least as long as the keys cuts nothing: keep the fused causal path
        window = self.sliding_window if self.sliding_window is not None and self.sliding_window < t else None
        chunk = self.chunk_size if self.chunk_size is not None and self.chunk_size < t else None
        if window is None and chunk is None and self.sinks is None and doc_ids is None and offset == 0:
            if self.causal_kernel is not None:
                return self.causal_kernel(q, k, v)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        mask = visible_keys(s, window, q.device, chunk=chunk, doc_ids=doc_ids, q_offset=offset, kv_len=t)
        return masked_attention(q, k, v, mask, self.sinks)

    def init_weights(self, out_std: float, in_std: float = 0.02) -> None:
        for w in (self.wq, self.wk, self.wv):
            trunc_normal_(w.weight, in_std)
            if w.bias is not None:
                nn.init.zeros_(w.bias)
        trunc_normal_(self.wo.weight, out_std)
        if self.wo.bias is not None:
            nn.init.zeros_(self.wo.bias)
        if self.sinks is not None:  # logit 0: the sink starts as one more key scoring 0
            nn.init.zeros_(self.sinks)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()


# Extra head-dim columns that carry the sink logit (a multiple of 8 keeps fused kernels usable).
SINK_PAD = 8


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over q/k/v [B, H, S, D] (same head count) with a boolean ``mask`` ([S, S] or
    [B, 1, S, S], True = visible) and optionally a per-head sink logit ``sinks`` [H]; one SDPA call."""
    b, h, s, d = q.shape
    scale = d**-0.5
    if sinks is not None:
        # q . k_sink = 1 * sink / scale on the first pad column, so the scaled score is the sink.
        q_pad = torch.zeros(b, h, s, SINK_PAD, dtype=q.dtype, device=q.device)
        q_pad[..., 0] = 1
        q = torch.cat([q, q_pad], dim=-1)
        k = F.pad(k, (0, SINK_PAD))
        sink_key = F.pad((sinks.to(q.dtype) / scale).view(1, h, 1, 1).expand(b, h, 1, 1), (d, SINK_PAD - 1))
        k = torch.cat([k, sink_key], dim=2)
        v = F.pad(v, (0, 0, 0, 1))  # the sink's value is 0: its probability mass is dropped
        mask = F.pad(mask, (0, 1), value=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
