"""Attention precision policy: which dtype scaled-dot-product attention runs in.

Under bf16 training q/k/v arrive in bf16 and SDPA runs in bf16, which is what GPUs want. torch's
CPU flash-attention kernel is the exception: at small head dims it is slower in bf16 than in
fp32 (measured with torch 2.13, 2 threads, B=8 S=256, forward+backward per layer: head_dim 16
fp32 20 ms vs bf16 29 ms; head_dim 32 28 vs 27; head_dim 64 39 vs 37; head_dim 128 536 vs 359),
because the per-score softmax work dominates when each score costs only 2*head_dim FLOPs.
``auto`` therefore upcasts attention to fp32 on CPU below head_dim 32 and leaves it alone
everywhere else. fp32 attention is also the more accurate choice, so ``auto`` never trades
accuracy for speed.

The model exposes the knob (an attention module with ``sdpa_dtype`` and ``head_dim`` attributes,
e.g. ``models/common/attention.Attention``); this module sets it from outside, as the
parallelism modules do, so the model file carries no device rules.
"""

from __future__ import annotations

import torch

CPU_FP32_BELOW_HEAD_DIM = 32


def attention_dtype(mode: str, mixed_precision: str, device_type: str, head_dim: int) -> torch.dtype | None:
    """The dtype SDPA should run in, or None for the compute dtype."""
    if mode == "fp32":
        return torch.float32
    if mode == "compute" or mixed_precision == "fp32":
        return None
    if device_type == "cpu" and head_dim < CPU_FP32_BELOW_HEAD_DIM:
        return torch.float32
    return None


def apply_attention_precision(model: torch.nn.Module, mode: str, mixed_precision: str,
                              device: torch.device) -> torch.dtype | None:
    """Set every attention module's SDPA dtype from ``training.attention_precision`` (``mode``)."""
    chosen = None
    for module in model.modules():
        if hasattr(module, "sdpa_dtype") and hasattr(module, "head_dim"):  # any family's attention
            chosen = attention_dtype(mode, mixed_precision, device.type, module.head_dim)
            module.sdpa_dtype = chosen
    return chosen
