"""Gated DeltaNet: the linear-attention token mixer of Qwen3.5 / Qwen3-Next, as a common layer.

Per token: one projection gives q, k, v (concatenated, ``in_proj_qkv``), which pass a short
causal depthwise convolution (``conv1d``, width 4) and SiLU; q and k are L2-normalized per head;
``in_proj_b`` gives the write strength beta = sigmoid(b), ``in_proj_a`` the decay
g = -exp(A_log) * softplus(a + dt_bias); the gated delta rule (``gated_delta_rule.py``) mixes
the tokens; a gated RMSNorm (RMSNorm(o) * weight * SiLU(z), z from ``in_proj_z``) and
``out_proj`` close it. Parameter names and shapes are transformers' ``Qwen3_5GatedDeltaNet``'s,
so a checkpoint maps 1:1 (``conv1d.weight`` [C, 1, W] included).

Three ways to run it:

* ``forward(x, document_ids)``: training, the chunked form (``chunk_size`` tokens per chunk).
  With ``document_ids`` [B, S] (``masking.document_ids``, packed sequences) the recurrent state
  and the convolution window restart at every document: a document never sees another's state.
* ``prefill(x, state)`` -> (y, state): the chunked form that also returns the state a decoder
  continues from.
* ``step(x, state)`` -> (y, state): the recurrent form, token by token (decoding).

``kernel`` is a hook, None = the plain torch forms here: a training policy may install faster
kernels from outside (``titan_hydra.kernels.gated_delta_policy``: flash-linear-attention on
CUDA), as ``Attention.causal_kernel`` is filled. Head counts are read off the projected shapes,
and the module knows nothing of parallelism; a tensor-parallel plan would have to shard the q, k
and v parts of ``in_proj_qkv`` and of the convolution each by heads (one contiguous column
shard of the concatenation would mix them).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from titan_hydra.models.common.gated_delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from titan_hydra.models.common.layers import trunc_normal_


class GatedDeltaNetState(NamedTuple):
    """What decoding carries from token to token: the last W-1 convolution inputs [B, C, W-1]
    and the recurrent state [B, Hv, dk, dv] (fp32)."""

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
    and its CPU backward was the slower of the two in local timings), and a document reset is
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
        conv_dim = 2 * key_dim + value_dim
        self.in_proj_qkv = nn.Linear(dim, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(dim, value_dim, bias=False)
        self.in_proj_b = nn.Linear(dim, n_v_heads, bias=False)
        self.in_proj_a = nn.Linear(dim, n_v_heads, bias=False)
        # an nn.Conv1d only to hold the weight under transformers' name and shape [C, 1, W]
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, conv_width, groups=conv_dim, bias=False,
                                padding=conv_width - 1)
        self.dt_bias = nn.Parameter(torch.ones(n_v_heads))
        self.A_log = nn.Parameter(torch.empty(n_v_heads).uniform_(0.01, 16).log())
        self.norm = GatedRMSNorm(v_head_dim, norm_eps)
        self.out_proj = nn.Linear(value_dim, dim, bias=False)
        # replacement kernels (None = the torch forms), installed by a training policy
        self.kernel = None

    def forward(self, x: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        starts = None if document_ids is None else document_starts(document_ids)
        return self._mix(x, starts, None, chunked=True, kernel=self.kernel)[0]

    def prefill(self, x: torch.Tensor, state: GatedDeltaNetState | None = None
                ) -> tuple[torch.Tensor, GatedDeltaNetState]:
        """The chunked form from ``state`` (None: from nothing), returning the state after x."""
        return self._mix(x, None, state, chunked=True)

    def step(self, x: torch.Tensor, state: GatedDeltaNetState | None = None
             ) -> tuple[torch.Tensor, GatedDeltaNetState]:
        """The recurrent form: x [B, S, D] (S = 1 when decoding) from ``state``; returns the new state."""
        return self._mix(x, None, state, chunked=False)

    def _mix(self, x: torch.Tensor, starts: torch.Tensor | None, state: GatedDeltaNetState | None,
             *, chunked: bool, kernel=None) -> tuple[torch.Tensor, GatedDeltaNetState | None]:
        """``kernel``: the installed kernels, for training calls only (they take no state and
        return none; a returned state is None then)."""
        bsz, s, _ = x.shape
        weight = self.conv1d.weight.squeeze(1)
        if kernel is not None:
            mixed, history = kernel.conv(self.in_proj_qkv(x), weight, starts), None
        else:
            mixed, history = causal_conv(self.in_proj_qkv(x), weight, None if state is None else state.conv, starts)
        q, k, v = self._heads(mixed)
        beta = self.in_proj_b(x).sigmoid()
        wide = torch.promote_types(x.dtype, torch.float32)
        g = -self.A_log.to(wide).exp() * F.softplus(self.in_proj_a(x).to(wide) + self.dt_bias)
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
        return out, (None if history is None else GatedDeltaNetState(history, final))

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split the convolved q|k|v [B, S, C] into heads (widths read off the shapes)."""
        bsz, s, ch = mixed.shape
        value_dim = self.in_proj_z.weight.shape[0]
        key_dim = (ch - value_dim) // 2
        q, k, v = mixed.split([key_dim, key_dim, value_dim], dim=-1)
        return (q.reshape(bsz, s, -1, self.k_head_dim), k.reshape(bsz, s, -1, self.k_head_dim),
                v.reshape(bsz, s, -1, self.v_head_dim))

    def init_weights(self, out_std: float, in_std: float = 0.02) -> None:
        for proj in (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a):
            trunc_normal_(proj.weight, in_std)
        trunc_normal_(self.out_proj.weight, out_std)
        nn.init.kaiming_uniform_(self.conv1d.weight, a=math.sqrt(5))  # nn.Conv1d's own default
        with torch.no_grad():
            nn.init.ones_(self.dt_bias)
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16).log())  # transformers' init
        self.norm.weight.data.fill_(1.0)
