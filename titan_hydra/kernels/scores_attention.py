"""Causal attention through its score matrix: q @ k^T, a causal mask, an fp32 softmax, @ v.

Why, next to SDPA: on CPU at short sequences the score matrix is small and two batched bf16
matmuls (oneDNN) beat torch's CPU flash kernel, which walks the sequence in blocks. On an AMD
EPYC (AVX512-BF16, 2 threads), forward + backward of one layer under bf16 autocast at batch 8,
16 heads, length 256, DeepSeek-V3's MLA widths (q/k 192, v 128): 115 ms against 200 ms for
flash (whose single head size makes v padded to 192); 128-wide heads at batch 4 about 0.8x
flash's time. At length 512 flash wins (169 vs 317 ms), and the scores cost B x H x S x S values
per layer, so ``attention_kernel=auto`` only times this kernel up to ``MAX_SEQ`` and keeps
whichever is faster on the machine.

q and k may be wider than v (MLA): no padding is needed. The softmax runs in fp32 and its
probabilities are rounded once to v's dtype, as SDPA's math path does.
"""

from __future__ import annotations

import torch

MAX_SEQ = 512  # auto never considers longer sequences (memory ~ S^2, and flash is faster there)


def _future_keys(q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
    """[q_len, k_len] bool, True where a key lies after the query (aligned at the end)."""
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).triu(k_len - q_len + 1)


def scores_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Causal softmax attention of [B, H, S, D] q/k and [B, H, S, Dv] v -> [B, H, S, Dv]."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    # scale on q (S x D values, not S x S), mask in the matmul's dtype, softmax widened to fp32 in
    # its own pass: 115 ms against 173 for an fp32 copy of the scores first (MLA shape above)
    scores = torch.matmul(q * scale, k.transpose(-2, -1))
    scores = scores.masked_fill(_future_keys(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype), v)
