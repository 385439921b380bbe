"""Training loss: token-level cross entropy over the whole vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy; logits upcast to fp32 so bf16 runs stay stable.

    Under tensor-parallel loss parallel the logits are a vocab-sharded DTensor and the loss a
    replicated DTensor scalar; it is returned as a plain tensor (differentiably) so that
    accumulation, cross-rank averaging and validation treat every layout alike.
    """
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
    return loss.full_tensor() if isinstance(loss, DTensor) else loss
