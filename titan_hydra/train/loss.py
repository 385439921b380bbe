"""Training loss: token-level cross entropy over the whole vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy; logits upcast to fp32 so bf16 runs stay stable."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
