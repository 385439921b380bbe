"""Gated DeltaNet: the linear-attention token mixer of Qwen3.5 / Qwen3-Next, as a common layer.

Per token: three projections give q, k, v (``in_proj_q`` / ``in_proj_k`` / ``in_proj_v``), each
passing a short causal depthwise convolution of its own channels (``conv_q`` / ``conv_k`` /
``conv_v``, width 4) and SiLU; q and k are L2-normalized per head; ``in_proj_b`` gives the write
strength beta = sigmoid(b), ``in_proj_a`` the decay g = -exp(A_log) * softplus(a + dt_bias); the
gated delta rule (``gated_delta_rule.py``) mixes the tokens, value head j reading key head
j // (Hv / Hk); a gated RMSNorm (RMSNorm(o) * weight * SiLU(z), z from ``in_proj_z``) and
``out_proj`` close it. transformers' ``Qwen3_5GatedDeltaNet`` fuses q | k | v into one
``in_proj_qkv`` and one ``conv1d`` over the concatenation; the conversion (``qwen3_5/hf.py``)
concatenates and splits the rows, so a checkpoint maps 1:1 otherwise.

Why split: tensor parallel shards every part by whole heads (rank r keeps key heads
r Hk/tp.. and the value heads that read them, so the grouping above holds locally). One
contiguous column shard of the fused projection would give a rank some queries and no keys.
The module knows nothing of parallelism: head counts are read off the projected shapes, and the
weights it reads directly (convolutions, ``dt_bias``, ``A_log``) through ``layers.local_part``.

Three ways to run it:

* ``forward(x, document_ids)``: training, the chunked form (``chunk_size`` tokens per chunk).
  With ``document_ids`` [B, S] (``masking.document_ids``, packed sequences) the recurrent state
  and the convolution window restart at every document: a document never sees another's state.
* ``prefill(x, state)`` -> (y, state): the chunked form that also returns the state a decoder
  continues from.
* ``step(x, state)`` -> (y, state): the recurrent form, token by token (decoding).

``kernel`` is a hook, None = the plain torch forms here: a training policy may install faster
kernels from outside (``titan_hydra.kernels.gated_delta_policy``: flash-linear-attention on
CUDA), as ``Attention.causal_kernel`` is filled.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from titan_hydra.models.common.gated_delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from titan_hydra.models.common.layers import local_part, trunc_normal_, trunc_normal_stacked_


class GatedDeltaNetState(NamedTuple):
    """What decoding carries from token to token: the last W-1 convolution inputs [B, C, W-1]
    (the q, k and v channels one after another) and the recurrent state [B, Hv, dk, dv] (fp32)."""

    conv: torch.Tensor
    recurrent: torch.Tensor


class GatedRMSNorm(nn.Module):
    """RMSNorm(x) * weight * SiLU(gate), in fp32, returned in x's dtype (transformers' RMSNormGated)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        wide = torch.promote_types(x.dtype, torch.float32)
        normed = F.rms_norm(x.to(wide), (x.shape[-1],), eps=self.eps).to(x.dtype) * self.weight
        return (normed * F.silu(gate.to(wide))).to(x.dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim, in fp32 (flash-linear-attention's in-kernel form)."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] document ids -> [B, S] bool, True where a new document begins (never at position 0:
    a window's first tokens continue whatever came before)."""
    starts = torch.zeros_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return starts


def causal_conv(x: torch.Tensor, weight: torch.Tensor, history: torch.Tensor | None = None,
                starts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise convolution + SiLU: x [B, S, C], weight [C, W], ``history`` [B, C, W-1]
    (the inputs before x; zeros if None). A tap that reaches back past a document start reads
    zero instead. Returns (y [B, S, C], the last W-1 inputs [B, C, W-1]).

    W shifted multiply-adds in x's own layout: no transposes (a grouped conv1d wants [B, C, S],
    and its CPU backward is the slower of the two), and a document reset is
    one mask per tap."""
    bsz, s, ch = x.shape
    width = weight.shape[-1]
    before = x.new_zeros(bsz, width - 1, ch) if history is None else history.transpose(1, 2).to(x.dtype)
    padded = torch.cat([before, x], dim=1)
    weight = weight.to(x.dtype)
    if starts is not None:
        # tokens since the latest document start (a large number before the first one)
        idx = torch.arange(s, device=x.device)
        latest = torch.where(starts, idx, -s - width).cummax(dim=-1).values
        since = (idx - latest).unsqueeze(-1)
    y = None
    for lag in range(width):
        tap = padded[:, width - 1 - lag: width - 1 - lag + s] * weight[:, width - 1 - lag]
        tap = tap if starts is None or lag == 0 else tap * (since >= lag)
        y = tap if y is None else y + tap
    return F.silu(y), padded[:, s:].transpose(1, 2)


class GatedDeltaNet(nn.Module):
    def __init__(self, dim: int, n_k_heads: int, n_v_heads: int, k_head_dim: int, v_head_dim: int, *,
                 conv_width: int = 4, norm_eps: float = 1e-6, chunk_size: int = 64):
        super().__init__()
        if n_v_heads % n_k_heads:
            raise ValueError(f"n_v_heads={n_v_heads} must be a multiple of n_k_heads={n_k_heads}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size} must be >= 1")
        self.k_head_dim, self.v_head_dim = k_head_dim, v_head_dim
        self.chunk_size = chunk_size
        key_dim, value_dim = n_k_heads * k_head_dim, n_v_heads * v_head_dim
        self.in_proj_q = nn.Linear(dim, key_dim, bias=False)
        self.in_proj_k = nn.Linear(dim, key_dim, bias=False)
        self.in_proj_v = nn.Linear(dim, value_dim, bias=False)
        self.in_proj_z = nn.Linear(dim, value_dim, bias=False)
        self.in_proj_b = nn.Linear(dim, n_v_heads, bias=False)
        self.in_proj_a = nn.Linear(dim, n_v_heads, bias=False)
        # nn.Conv1d only to hold each depthwise weight [C, 1, W] (transformers' layout, and its init);
        # causal_conv reads it
        self.conv_q, self.conv_k, self.conv_v = (
            nn.Conv1d(c, c, conv_width, groups=c, bias=False, padding=conv_width - 1)
            for c in (key_dim, key_dim, value_dim))
        self.dt_bias = nn.Parameter(torch.ones(n_v_heads))
        self.A_log = nn.Parameter(torch.empty(n_v_heads).uniform_(0.01, 16).log())
        self.norm = GatedRMSNorm(v_head_dim, norm_eps)
        self.out_proj = nn.Linear(value_dim, dim, bias=False)
        # replacement kernels (None = the torch forms), installed by a training policy
        self.kernel = None

    def forward(self, x: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        starts = None if document_ids is None else document_starts(document_ids)
        return self._mix(x, starts, None, chunked=True, kernel=self.kernel, keep_state=False)[0]

    def prefill(self, x: torch.Tensor, state: GatedDeltaNetState | None = None
                ) -> tuple[torch.Tensor, GatedDeltaNetState]:
        """The chunked form from ``state`` (None: from nothing), returning the state after x."""
        return self._mix(x, None, state, chunked=True)

    def step(self, x: torch.Tensor, state: GatedDeltaNetState | None = None
             ) -> tuple[torch.Tensor, GatedDeltaNetState]:
        """The recurrent form: x [B, S, D] (S = 1 when decoding) from ``state``; returns the new state."""
        return self._mix(x, None, state, chunked=False)

    def _mix(self, x: torch.Tensor, starts: torch.Tensor | None, state: GatedDeltaNetState | None,
             *, chunked: bool, kernel=None, keep_state: bool = True
             ) -> tuple[torch.Tensor, GatedDeltaNetState | None]:
        """``kernel``: the installed kernels, for training calls only (they take no state and
        return none). The returned state is None with a kernel or without ``keep_state``."""
        bsz, s, _ = x.shape
        (q, k, v), history = self._convolve(x, starts, state, kernel)
        beta = self.in_proj_b(x).sigmoid()
        wide = torch.promote_types(x.dtype, torch.float32)
        decay = -local_part(self.A_log).to(wide).exp()
        g = decay * F.softplus(self.in_proj_a(x).to(wide) + local_part(self.dt_bias))
        scale = self.k_head_dim**-0.5
        if kernel is not None:
            o, final = kernel.rule(q, k, v, g, beta, scale, self.chunk_size, starts), None
        else:
            q, k = l2_normalize(q), l2_normalize(k)
            initial = None if state is None else state.recurrent
            rule = chunk_gated_delta_rule if chunked else recurrent_gated_delta_rule
            extra = {"chunk_size": self.chunk_size} if chunked else {}
            o, final = rule(q, k, v, g, beta, scale=scale, starts=starts, initial_state=initial, **extra)
        z = self.in_proj_z(x).view(bsz, s, -1, self.v_head_dim)
        out = self.out_proj(self.norm(o.to(x.dtype), z).reshape(bsz, s, -1))
        if kernel is not None or not keep_state:
            return out, None
        return out, GatedDeltaNetState(torch.cat(history, dim=1), final)

    def _convolve(self, x: torch.Tensor, starts: torch.Tensor | None, state: GatedDeltaNetState | None, kernel
                  ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], list[torch.Tensor] | None]:
        """Project and convolve q, k and v, each on its own channels: ((q, k, v) split into heads
        [B, S, H, d], each part's last W-1 inputs [B, C_part, W-1] or None with a kernel)."""
        parts = [proj(x) for proj in (self.in_proj_q, self.in_proj_k, self.in_proj_v)]
        weights = [local_part(c.weight).squeeze(1) for c in (self.conv_q, self.conv_k, self.conv_v)]
        if kernel is not None:
            mixed, history = kernel.conv(parts, weights, starts), None
        else:
            before = (None,) * 3 if state is None else state.conv.split([w.shape[0] for w in weights], dim=1)
            mixed, history = zip(*(causal_conv(p, w, h, starts) for p, w, h in zip(parts, weights, before)))
        bsz, s, _ = x.shape
        dims = (self.k_head_dim, self.k_head_dim, self.v_head_dim)
        return tuple(m.reshape(bsz, s, -1, d) for m, d in zip(mixed, dims)), history

    def init_weights(self, out_std: float, in_std: float = 0.02) -> None:
        # q, k, v drawn as transformers' one fused matrix: a seed gives the weights it gave before the split
        trunc_normal_stacked_([self.in_proj_q.weight, self.in_proj_k.weight, self.in_proj_v.weight], in_std)
        for proj in (self.in_proj_z, self.in_proj_b, self.in_proj_a):
            trunc_normal_(proj.weight, in_std)
        trunc_normal_(self.out_proj.weight, out_std)
        for conv in (self.conv_q, self.conv_k, self.conv_v):
            nn.init.kaiming_uniform_(conv.weight, a=math.sqrt(5))  # nn.Conv1d's own default
        with torch.no_grad():
            nn.init.ones_(self.dt_bias)
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16).log())  # transformers' init
        self.norm.weight.data.fill_(1.0)
