"""Whether ``torch._grouped_mm`` (one GEMM over many row groups) runs on a device and dtype.

The op is private and its CPU and older-GPU support varies by torch build, so the MoE experts ask
here before taking the grouped path (else they loop over experts). The answer comes from running
the op once, forward and backward, kept per (device type, dtype) for the life of the process.
"""

from __future__ import annotations

import torch

_GROUPED_MM_WORKS: dict[tuple[str, torch.dtype], bool] = {}
PROBED_DTYPES = (torch.float32, torch.bfloat16)


def _probe_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs forward and backward here (odd group sizes, an empty group)."""
    try:
        # the caller may be inside no_grad (init_weights) or autocast: probe the op itself
        with torch.enable_grad(), torch.autocast(device.type, enabled=False), torch.device(device):
            return _run_grouped_mm_probe(device, dtype)
    except (AttributeError, RuntimeError, NotImplementedError, TypeError):
        return False


def _run_grouped_mm_probe(device: torch.device, dtype: torch.dtype) -> bool:
    x = torch.ones(5, 16, device=device, dtype=dtype, requires_grad=True)
    w = torch.ones(3, 16, 16, device=device, dtype=dtype, requires_grad=True)
    offs = torch.tensor([1, 1, 5], device=device, dtype=torch.int32)
    y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    y.backward(torch.ones_like(y))
    return bool(torch.isfinite(w.grad).all())


def grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Probed once per (device type, dtype) in eager mode (``probe_grouped_mm`` warms it); while
    torch.compile traces, an unprobed pair assumes the op exists."""
    key = (device.type, dtype)
    if key not in _GROUPED_MM_WORKS:
        if torch.compiler.is_compiling():
            return hasattr(torch, "_grouped_mm")
        _GROUPED_MM_WORKS[key] = _probe_grouped_mm(device, dtype)
    return _GROUPED_MM_WORKS[key]


def probe_grouped_mm(device: torch.device) -> None:
    """Decide grouped GEMM vs loop for ``device`` now, outside any compile (a meta device has no kernels)."""
    if device.type != "meta":
        for dtype in PROBED_DTYPES:
            grouped_mm_works(device, dtype)
