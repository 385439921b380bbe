"""The training loss of a model with multi-token prediction depths (``common/mtp.py``).

``loss = CE(main) + weight x mean over depths k of CE_k``, where depth k at position i is scored
against ``labels[i + k]`` (token t(i+k+1)) wherever ``valid[k]`` holds (DeepSeek-V3 report,
eq. 24-25: lambda / D x sum of the depth losses). The returned value is what is backpropagated
and reported as ``loss``; each call also records its MTP term, which a training hook
(``train/mtp_metrics.py``) averages over the step and logs as ``mtp/loss``.

A forward in eval mode returns plain logits: the loss is then the next-token cross entropy alone,
so validation loss compares with runs without MTP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from titan_hydra.models.common.mtp import shift_left
from titan_hydra.models.objective import cross_entropy_loss

IGNORE = -100


def depth_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, k: int, valid: torch.Tensor) -> torch.Tensor:
    """Mean CE of depth ``k``'s logits [B, S, V] against labels[:, i + k] over the valid positions."""
    target = torch.where(valid, shift_left(labels, k), torch.full_like(labels, IGNORE))
    total = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), ignore_index=IGNORE, reduction="sum")
    return total / valid.sum().clamp_min(1)


def mtp_term(depth_logits: list[torch.Tensor], labels: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean over the depths of their cross entropies (valid: [D, B, S])."""
    losses = [depth_cross_entropy(x, labels, k, valid[k - 1]) for k, x in enumerate(depth_logits, start=1)]
    return torch.stack(losses).mean()


class MultiTokenLoss:
    """``loss_fn(output, labels)`` for the runners; ``take(calls)`` the mean MTP term of the last
    ``calls`` training forwards (a step's microbatches), then forgets them."""

    def __init__(self, weight: float) -> None:
        self.weight = float(weight)
        self.recorded: list[torch.Tensor] = []

    def __call__(self, output, labels: torch.Tensor) -> torch.Tensor:
        if not isinstance(output, tuple):  # eval-mode forward: logits only
            return cross_entropy_loss(output, labels)
        logits, valid, *depths = output
        mtp = mtp_term(depths, labels, valid)
        self.recorded.append(mtp.detach().float())
        return cross_entropy_loss(logits, labels) + self.weight * mtp

    def take(self, calls: int) -> torch.Tensor | None:
        """Mean of the last ``calls`` recorded terms (None when this rank computed none: a pipeline
        rank without the last stage). Earlier ones (a pipeline's shape probe) are dropped."""
        kept, self.recorded = self.recorded[-calls:], []
        return torch.stack(kept).mean() if kept else None
