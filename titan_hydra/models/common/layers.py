"""Small layers every decoder family uses: RMSNorm, SwiGLU feed-forward, truncated-normal init,
and ``local_part`` for weights a module reads directly rather than through a module call."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor


def trunc_normal_(w: torch.Tensor, std: float) -> None:
    """Normal(0, std) truncated at +-3 std (keeps rare large weights out of the init)."""
    nn.init.trunc_normal_(w, mean=0.0, std=std, a=-3 * std, b=3 * std)


def trunc_normal_stacked_(weights: list[torch.Tensor], std: float) -> None:
    """``trunc_normal_`` drawn once on the row-wise stack of ``weights`` (the parts of what is one
    fused matrix elsewhere) and copied back, so a seed gives the parts the numbers the fused matrix
    would get (its rejection sampling redraws per call: separate calls give other numbers). Sharded
    parts (DTensors) draw each their own, as any sharded init does."""
    if any(isinstance(w, DTensor) for w in weights):
        for w in weights:
            trunc_normal_(w, std)
        return
    rows = [w.shape[0] for w in weights]
    stacked = weights[0].new_empty(sum(rows), *weights[0].shape[1:])
    trunc_normal_(stacked, std)
    with torch.no_grad():
        for w, part in zip(weights, stacked.split(rows)):
            w.copy_(part)


def local_part(w: torch.Tensor) -> torch.Tensor:
    """This rank's part of a weight read directly (not through a module call): a DTensor sharded by
    a parallel plan gives its local shard (differentiable), a plain tensor itself. The module then
    reads its local sizes off the shapes and never knows the layout."""
    return w.to_local() if isinstance(w, DTensor) else w


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 (stable under bf16), then scaled by a learned weight."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, out_std: float, in_std: float = 0.02) -> None:
        trunc_normal_(self.w1.weight, in_std)
        trunc_normal_(self.w3.weight, in_std)
        trunc_normal_(self.w2.weight, out_std)
