"""Which attention a run will use, and what upcast (fp32) attention adds to saved activations.

Its own module because it is the one place the planner asks the training code: the attention
precision policy (kernels/attention_precision.py) and the small-head kernel's choice (kernels/attention_policy.py,
which under ``attention_kernel=auto`` times the kernel against SDPA once per shape and caches the
answer). Re-deriving either here would give the planner a second, drifting copy of the policy.
"""

from __future__ import annotations

import math

import torch

from titan_hydra.kernels.small_head_attention import HEAD_DIM
from titan_hydra.planner.activations import ATTN_FP32_EXTRA
from titan_hydra.kernels.attention_policy import auto_picks_kernel
from titan_hydra.kernels.attention_precision import attention_dtype
from titan_hydra.spec import RunSpec


def small_head_kernel_applies(spec: RunSpec, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether ``training.attention_kernel`` would install the small-head kernel (its policy's
    static conditions: CPU, 16-wide heads, no context parallel, not forced to SDPA; under auto,
    also this CPU's measurement of the kernel against SDPA)."""
    args = spec.shape
    choice = str(spec.training.attention_kernel)
    if choice == "sdpa" or str(spec.cluster.device) != "cpu" or args.head_dim != HEAD_DIM or spec.dims.cp != 1:
        return False
    return choice == "small_head" or auto_picks_kernel(args.n_heads, spec.batch.seq_len, dtype)


def fp32_attention_bytes(spec: RunSpec, tokens: float, layers: int) -> float:
    """What upcast attention adds to the saved activations (0 unless it is in effect).

    The small-head CPU kernel (kernels/attention_policy.py) replaces the upcast where it applies:
    it widens bf16 q/k/v inside and saves only them, the output and an fp32 logsumexp, as SDPA."""
    args, mp, tp = spec.shape, spec.mixed_precision, spec.dims.tp
    ac = spec.activation_checkpoint
    mode = str(spec.training.attention_precision)
    if mp != "bf16" or attention_dtype(mode, mp, str(spec.cluster.device), args.head_dim, spec.batch.seq_len) is None:
        return 0.0
    if small_head_kernel_applies(spec, torch.float32):  # the upcast SDPA it would replace
        return 0.0
    per_block = tokens * args.dim / tp
    if ac.mode in ATTN_FP32_EXTRA:  # none / selective_op: every block keeps its copies
        return layers * per_block * ATTN_FP32_EXTRA[ac.mode]
    if ac.mode == "selective_layer":
        plain = layers - math.ceil(layers / max(ac.freq, 1))
        return max(plain, 1) * per_block * ATTN_FP32_EXTRA["none"]
    return per_block * ATTN_FP32_EXTRA["none"]  # full: the one block being recomputed
