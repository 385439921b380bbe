"""Attention precision policy: which dtype scaled-dot-product attention runs in.

Under bf16 training q/k/v arrive in bf16 and SDPA runs in bf16, which is what GPUs want. torch's
CPU flash-attention kernel is the exception for small heads at short sequences, where its bf16
path is slower than its fp32 one: the per-score softmax work dominates when each score costs
only 2*head_dim FLOPs, and below 768 queries the kernel also switches to small query blocks
(bf16 / fp32 time by head width and length: docs/bench/notes_models.md). ``auto`` therefore
upcasts attention to fp32 on CPU only below head_dim 32 AND below 1024 tokens per sequence, and
leaves it in the compute dtype everywhere else (GPUs always).
``fp32`` forces the upcast (the more accurate choice), ``compute`` forbids it.

The model exposes the knob (an attention module with ``sdpa_dtype`` and ``head_dim`` attributes,
e.g. ``models/common/attention.Attention``); this module sets it from outside, as the
parallelism modules do, so the model file carries no device rules.
"""

from __future__ import annotations

import torch

CPU_FP32_BELOW_HEAD_DIM = 32
CPU_FP32_BELOW_SEQ_LEN = 1024


def attention_dtype(mode: str, mixed_precision: str, device_type: str, head_dim: int,
                    seq_len: int | None = None) -> torch.dtype | None:
    """The dtype SDPA should run in, or None for the compute dtype. ``seq_len``: tokens per
    sequence the attention kernel sees (``training.seq_len``; None = short)."""
    if mode == "fp32":
        return torch.float32
    if mode == "compute" or mixed_precision == "fp32":
        return None
    if device_type == "cpu" and head_dim < CPU_FP32_BELOW_HEAD_DIM and (seq_len or 0) < CPU_FP32_BELOW_SEQ_LEN:
        return torch.float32
    return None


def apply_attention_precision(model: torch.nn.Module, mode: str, mixed_precision: str,
                              device: torch.device, seq_len: int | None = None) -> torch.dtype | None:
    """Set every attention module's SDPA dtype from ``training.attention_precision`` (``mode``)."""
    chosen = None
    for module in model.modules():
        if hasattr(module, "sdpa_dtype") and hasattr(module, "head_dim"):  # any family's attention
            chosen = attention_dtype(mode, mixed_precision, device.type, module.head_dim, seq_len)
            module.sdpa_dtype = chosen
    return chosen
