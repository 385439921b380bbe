"""Attention kernel policy: which implementation runs the plain causal attention call.

``training.attention_kernel``:

* ``auto`` (default): the hand-written small-head kernel (``titan_hydra/kernels``) on CPU where
  every attention module has 16-wide heads and context parallelism is off; SDPA everywhere else.
  If the kernel cannot be built here (no C++ compiler), ``auto`` logs one line and uses SDPA.
* ``sdpa``: always ``F.scaled_dot_product_attention`` (torch's fused kernels).
* ``small_head``: require the kernel; a configuration it cannot serve is refused with one line
  before the model is built any further.

Why a policy and not a model option: which kernel is fastest depends on the device and the head
width, not on the architecture, so the model only exposes a hook (``Attention.causal_kernel``)
and this module fills it from outside, as ``precision.py`` does for the attention dtype. Calls
with a window, chunk, sinks, document mask or KV cache keep their SDPA path; the kernel computes
in fp32 whatever its inputs (bf16 q/k/v are widened on the way in, the output narrowed back).
Context parallel attention shards the sequence across ranks through SDPA's ring handlers, so
``cp > 1`` keeps SDPA.
"""

from __future__ import annotations

import logging

import torch

from titan_hydra.errors import ConfigError

log = logging.getLogger("titan_hydra")

KERNEL_NAME = "small_head"


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "causal_kernel") and hasattr(m, "head_dim")]


def why_not(model: torch.nn.Module, device: torch.device, cp: int) -> str | None:
    """Why the small-head kernel cannot serve this model and layout (None: it can)."""
    from titan_hydra.kernels.small_head_attention import HEAD_DIM

    modules = _attention_modules(model)
    if device.type != "cpu":
        return f"it is a CPU kernel and this run is on {device.type}"
    if cp > 1:
        return "context parallel attention (cp > 1) runs through SDPA's ring handlers"
    if not modules:
        return "the model has no attention module with a causal_kernel hook"
    widths = sorted({int(m.head_dim) for m in modules})
    if widths != [HEAD_DIM]:
        return f"it computes {HEAD_DIM}-wide heads and this model's are {widths}"
    return None


def apply_attention_kernel(model: torch.nn.Module, choice: str, device: torch.device, cp: int = 1) -> str:
    """Install the kernel chosen by ``training.attention_kernel`` (``choice``); returns its name."""
    if choice == "sdpa":
        return "sdpa"
    reason, unavailable = why_not(model, device, cp), False
    if reason is None:
        from titan_hydra.kernels.small_head_attention import KernelUnavailable, causal_attention, warm_up

        try:
            warm_up()
        except KernelUnavailable as e:
            reason, unavailable = str(e), True
        else:
            for module in _attention_modules(model):
                module.causal_kernel = causal_attention
                module.sdpa_dtype = None  # the kernel computes in fp32 anyway: no upcast copies
            return KERNEL_NAME
    if choice == KERNEL_NAME:
        raise ConfigError(f"training.attention_kernel=small_head cannot be used: {reason}; "
                          f"use training.attention_kernel=auto or sdpa")
    if unavailable:  # auto on a machine that should have had it: say so once
        log.warning("attention: %s; using SDPA", reason)
    return "sdpa"
