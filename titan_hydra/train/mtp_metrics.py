"""``mtp/loss`` once per optimizer step: the multi-token prediction term of the training loss.

The loss object (``models/common/mtp_loss.MultiTokenLoss``) records the term of each microbatch it
scores; only the rank holding a pipeline's last stage scores any. This hook averages the step's
records, shares them over the pipeline (as the runner does with the loss) and averages over the
data x context parallel ranks, so every rank logs the number the main loss is logged beside.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from titan_hydra.models.common.mtp_loss import MultiTokenLoss


def mtp_loss_hooks(loss_fn: Any, dims: Any, loss_scale: float | Callable[[], float], device: torch.device
                   ) -> list[Callable[[], dict[str, float]]]:
    """The hook for a run whose loss has MTP terms (none otherwise). ``loss_scale`` is the
    runner's per-microbatch weight: 1 / (gradient accumulation x pipeline microbatches), or a
    function giving the current step's (a batch schedule changes the accumulation)."""
    if not isinstance(loss_fn, MultiTokenLoss):
        return []

    def step() -> dict[str, float]:
        scale = loss_scale() if callable(loss_scale) else loss_scale
        value = loss_fn.take(max(1, round(1.0 / scale)))
        local = value.to(device) if value is not None else torch.zeros((), device=device)
        return {"mtp/loss": dims.global_mean(dims.broadcast_pp_loss(local))}

    return [step]
