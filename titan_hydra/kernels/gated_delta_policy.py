"""Gated DeltaNet kernel policy: which implementation runs the chunked delta rule and its convolution.

``choice``:

* ``auto``: flash-linear-attention's Triton kernels (``chunk_gated_delta_rule`` and
  ``causal_conv1d``) when the run is on CUDA and the optional extra is installed
  (``pip install titan_hydra[fla]``); the plain torch forms (``models/common/gated_delta_rule.py``)
  everywhere else. The reason goes into the run header, as the attention kernel's does.
* ``torch``: always the torch forms (any device; its chunk size is the layer's setting).
* ``fla``: require the kernels; a run that cannot have them is refused with one line.

The model only exposes a hook (``GatedDeltaNet.kernel``, None = torch) and this module fills
it from outside, as ``attention_policy.py`` fills ``Attention.causal_kernel``: which kernel is
fastest depends on the device, not on the architecture. The kernels serve training calls only
(no state in or out); decoding keeps the torch recurrent form. flash-linear-attention's chunk
is 64 tokens whatever the layer's ``chunk_size``; packed documents reach it as ``cu_seqlens``
over the flattened batch (its variable-length form), so every document starts from a zero
state and an empty convolution window, as in the torch forms.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Callable, NamedTuple

import torch

from titan_hydra.errors import ConfigError
from titan_hydra.kernels.attention_policy import KernelChoice

FLA = "fla"
TORCH = "torch"
CHOICES = ("auto", TORCH, FLA)


class DeltaKernels(NamedTuple):
    """What ``GatedDeltaNet.kernel`` holds: ``conv(xs, weights, starts) -> ys`` (with SiLU), the
    layer's q, k and v parts each convolved on its own channels (x [B,S,C], weight [C,W], one call
    so the document boundaries are found once), and ``rule(q, k, v, g, beta, scale, chunk_size,
    starts) -> o`` (q/k not yet L2-normalized)."""

    conv: Callable
    rule: Callable


@functools.cache
def fla_import_error() -> str | None:
    """Why flash-linear-attention cannot be used here (None: it can). Imported on first ask only:
    a CPU run never pays for importing Triton."""
    try:
        import fla.modules.causal_conv1d  # noqa: F401
        import fla.ops.gated_delta_rule  # noqa: F401
        from fla.ops.common import chunk_o
    except Exception as e:  # ImportError, or Triton failing to find a driver
        return f"flash-linear-attention is not importable ({type(e).__name__}: {e}; pip install titan_hydra[fla])"
    # 0.6.0 raises in the backward of the gated chunk kernel on Hopper with Triton 3.4-3.7.0
    # (wrong results there, its issue #640) unless tilelang serves that kernel instead
    refused = all(getattr(chunk_o, flag, False) for flag in ("IS_NVIDIA_HOPPER", "TRITON_ABOVE_3_4_0"))
    if refused and not getattr(chunk_o, "TRITON_ABOVE_3_7_1", True) and importlib.util.find_spec("tilelang") is None:
        import triton

        return (f"flash-linear-attention refuses its backward on Hopper with Triton {triton.__version__}; "
                f"it needs Triton >= 3.7.1 or tilelang")
    return None


def cu_seqlens(starts: torch.Tensor) -> torch.Tensor:
    """[B, S] document starts -> the boundaries of every document of the flattened [1, B*S] batch
    (each row also starts one), int64 [N+1] as flash-linear-attention's varlen calls want."""
    bsz, s = starts.shape
    begins = starts.clone()
    begins[:, 0] = True
    idx = begins.flatten().nonzero().squeeze(-1)
    return torch.cat([idx, idx.new_tensor([bsz * s])])


def _fla_conv(xs: list[torch.Tensor], weights: list[torch.Tensor], starts: torch.Tensor | None) -> list[torch.Tensor]:
    from fla.modules.causal_conv1d import causal_conv1d

    if starts is None:
        return [causal_conv1d(x, w.to(x.dtype), activation="silu")[0] for x, w in zip(xs, weights)]
    bounds = cu_seqlens(starts)
    return [causal_conv1d(x.flatten(0, 1).unsqueeze(0), w.to(x.dtype), activation="silu", cu_seqlens=bounds)[0]
            .view_as(x) for x, w in zip(xs, weights)]


def _fla_rule(q, k, v, g, beta, scale: float, chunk_size: int, starts: torch.Tensor | None) -> torch.Tensor:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    if starts is None:
        return chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=True)[0]
    flat = [t.flatten(0, 1).unsqueeze(0) for t in (q, k, v, g, beta)]
    o = chunk_gated_delta_rule(*flat, scale=scale, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens(starts))[0]
    return o.view_as(v)


FLA_KERNELS = DeltaKernels(_fla_conv, _fla_rule)


def choose(choice: str, device: torch.device) -> KernelChoice:
    """The kernel ``choice`` resolves to on ``device``, with the reason the run header prints."""
    if choice not in CHOICES:
        raise ConfigError(f"training.gated_delta_kernel={choice!r} is not one of {', '.join(CHOICES)}; use auto")
    if choice == TORCH:
        return KernelChoice(TORCH, "set explicitly")
    why = None if device.type == "cuda" else f"its kernels are Triton on CUDA and this run is on {device.type}"
    why = why or fla_import_error()
    if choice == FLA:
        if why is not None:
            raise ConfigError(f"training.gated_delta_kernel=fla: gated delta kernel fla cannot be used: {why}; "
                              "use training.gated_delta_kernel=auto or torch")
        return KernelChoice(FLA, "set explicitly")
    if why is not None:
        return KernelChoice(TORCH, f"auto: flash-linear-attention does not apply ({why})")
    return KernelChoice(FLA, "auto: CUDA and flash-linear-attention are present")


def delta_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The Gated DeltaNet layers of ``model`` (what has the ``kernel`` hook and a decay ``A_log``)."""
    return [m for m in model.modules() if hasattr(m, "kernel") and hasattr(m, "A_log")]


def apply_gated_delta_kernel(model: torch.nn.Module, choice: str, device: torch.device) -> KernelChoice:
    """Install the chosen kernels on every Gated DeltaNet layer of ``model`` (their ``kernel`` hook)."""
    layers = delta_layers(model)
    if not layers:
        return KernelChoice(TORCH, "the model has no Gated DeltaNet layer")
    picked = choose(choice, device)
    for layer in layers:
        layer.kernel = FLA_KERNELS if picked.name == FLA else None
    return picked
