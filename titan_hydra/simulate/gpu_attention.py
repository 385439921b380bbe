"""Masked attention as a GPU runs it, for the fake tensors of a run that targets a GPU.

A boolean mask (packed documents, sliding windows, chunks, attention sinks) sends CPU SDPA down
its math path, which saves the fp32 attention probabilities for backward: [B, H, S, keys] per
layer, 8 GiB per gpt_oss layer at 2 x 4,096 tokens. On a GPU the same call takes the
memory-efficient kernel: it takes the mask as an additive bias in the inputs' dtype (mask-shaped,
broadcast over batch and heads) and saves only its output and an fp32 log-sum-exp per head and
position. While a rank of a GPU run is simulated, ``F.scaled_dot_product_attention`` with a mask
becomes that kernel's op, ``aten._scaled_dot_product_efficient_attention``, whose meta
implementation fake tensors run (forward and backward). Unmasked calls keep CPU's flash kernel,
which saves what CUDA's flash kernel saves; DTensor inputs (context parallel) keep their handlers.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

NOTE = ("masked attention (documents, windows, chunks, sinks): the CUDA memory-efficient kernel's op runs "
        "(output, fp32 log-sum-exp, the mask as a bias in the inputs' dtype), not CPU's math path, which would "
        "save fp32 probabilities")


def additive_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float bias a GPU's SDPA makes of a boolean mask (0 where visible, -inf where not)."""
    if mask.dtype != torch.bool:
        return mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def efficient_attention(q, k, v, mask, scale=None) -> torch.Tensor:
    """``aten._scaled_dot_product_efficient_attention`` on q/k/v [B, H, S, D] with ``mask``."""
    bias = additive_bias(mask, q.dtype).expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    out, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, False, scale=scale)
    return out


@contextlib.contextmanager
def efficient_masked_attention() -> Iterator[None]:
    """Masked SDPA calls become the memory-efficient kernel's op meanwhile (module docstring).

    ``F.scaled_dot_product_attention`` itself is swapped, not intercepted by a TorchFunctionMode:
    activation checkpointing recomputes a block inside backward, where function modes are not
    active, and the recomputation must save what the forward saved. The swap lives in the
    simulated rank's own process and is undone on exit."""
    real = F.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        plain = (attn_mask is not None and not is_causal and not dropout_p and not enable_gqa
                 and query.shape[1] == key.shape[1]
                 and not any(isinstance(t, DTensor) for t in (query, key, value, attn_mask)))
        if plain:
            return efficient_attention(query, key, value, attn_mask, scale)
        return real(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = real
