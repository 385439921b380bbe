"""Muon for sharded 2-D weights: torch.optim.Muon's update, with the orthogonalization done on
the whole matrix.

Muon replaces a matrix's (Nesterov) momentum by its nearest semi-orthogonal matrix (five
Newton-Schulz iterations), which needs the *whole* matrix: under FSDP or TP a rank holds only
a shard of it, and running torch.optim.Muon on DTensor shards either fails or orthogonalizes
each shard on its own (a different update). Here each DTensor's momentum is gathered
(``full_tensor``), every rank runs the same iterations on the same full matrix, and keeps its
own shard of the result (sliced locally: no second collective). The parameters and the
momentum buffers stay sharded, so FSDP's memory savings hold; the cost is one all-gather of
each matrix's update per step (torchtitan's users discuss distributing that work: future work).

The arithmetic is torch.optim.Muon's: ``buf = lerp(buf, g, 1 - momentum)``, the Nesterov
``lerp(g, buf, momentum)``, the quintic iteration with its coefficients, decoupled weight decay
``p *= 1 - lr * wd`` and the shape-adjusted step (``adjust_lr_fn``: "original" =
sqrt(max(1, rows/cols)), "match_rms_adamw" = 0.2 sqrt(max(rows, cols))). One addition:
``ns_dtype`` (torch's is bfloat16) may be float32, which makes layouts agree to fp32 rounding, or
auto: bfloat16 where the parameters' device multiplies bf16 natively, float32 elsewhere (a CPU
without AVX512-BF16/AMX emulates bf16 matmuls ~50x slower than fp32; ``titan_hydra.hardware``).
On plain tensors with the defaults, updates equal torch.optim.Muon bit for bit (tested).
"""

from __future__ import annotations

import math

import torch

from titan_hydra.hardware import precision_dtype

NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)
NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
ADJUST_LR = ("original", "match_rms_adamw")


def orthogonalize(g: torch.Tensor, steps: int, coefficients: tuple[float, float, float], eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """The quintic Newton-Schulz iteration on a 2-D matrix (in ``dtype``), as torch.optim.Muon runs it."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, how: str | None, shape: torch.Size) -> float:
    rows, cols = shape[:2]
    if how in (None, "original"):
        return lr * math.sqrt(max(1.0, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))


def _whole(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _like(full: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``full`` laid out as ``ref`` (this rank's shard of it when ``ref`` is a DTensor)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(ref, DTensor):
        return full
    # every rank holds the same full matrix: slice locally, no scatter from a source rank
    return distribute_tensor(full, ref.device_mesh, ref.placements, src_data_rank=None)


def ns_dtype_of(name: str, device: torch.device) -> torch.dtype:
    """The Newton-Schulz dtype ``name`` means for parameters on ``device`` (auto: the hardware's)."""
    return precision_dtype("auto", device.type) if name == "auto" else NS_DTYPES[name]


class Muon(torch.optim.Optimizer):
    """``Muon(params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5, eps=1e-7,
    adjust_lr_fn=None, ns_dtype="bfloat16")``: for 2-D parameters, plain or DTensor (FSDP / TP)."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, eps: float = 1e-7, adjust_lr_fn: str | None = None,
                 ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS, ns_dtype: str = "bfloat16"):
        if lr < 0 or weight_decay < 0 or momentum < 0:
            raise ValueError(f"Muon needs lr, weight_decay and momentum >= 0 (got {lr}, {weight_decay}, {momentum})")
        if adjust_lr_fn is not None and adjust_lr_fn not in ADJUST_LR:
            raise ValueError(f"Muon adjust_lr_fn={adjust_lr_fn!r} is not one of {', '.join(ADJUST_LR)}")
        if ns_dtype not in (*NS_DTYPES, "auto"):
            raise ValueError(f"Muon ns_dtype={ns_dtype!r} is not one of {', '.join(NS_DTYPES)}, auto")
        if not 0 < ns_steps < 100:
            raise ValueError(f"Muon ns_steps={ns_steps} must be in [1, 99]")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        eps=eps, adjust_lr_fn=adjust_lr_fn, ns_coefficients=tuple(ns_coefficients), ns_dtype=ns_dtype)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon takes 2-D parameters only, got one of shape {tuple(p.shape)}; select "
                                     "matrices for it (optimizer.param_groups: ndim: 2)")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd, mom = float(group["lr"]), group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mom)
                update = p.grad.lerp(buf, mom) if group["nesterov"] else buf
                ortho = orthogonalize(_whole(update), group["ns_steps"], group["ns_coefficients"], group["eps"],
                                      ns_dtype_of(group["ns_dtype"], p.device))
                p.mul_(1 - lr * wd)
                p.add_(_like(ortho.to(p.dtype), p), alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss
