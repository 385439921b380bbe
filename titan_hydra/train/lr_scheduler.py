"""Learning-rate schedules: linear warmup -> stable -> decay (linear, cosine or sqrt).

One function covers the `lr_scheduler` group's options: warmup_cosine and warmup_linear decay
over everything after warmup (``decay_ratio=None``), wsd keeps the peak until the last
``decay_ratio`` of training, constant has neither. The multiplier is a pure function of the
step, wrapped in a LambdaLR so its state checkpoints with the rest of the run.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch.optim.lr_scheduler import LambdaLR

DECAY_TYPES = ("linear", "cosine", "sqrt", "none")


def lr_multiplier(
    step: int,
    *,
    total_steps: int,
    warmup_steps: int,
    decay_ratio: float | None,
    decay_type: str,
    min_lr_factor: float,
) -> float:
    """Multiplier of the peak LR used for optimizer step ``step`` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        # (step + 1) so the first step already trains with a non-zero LR.
        return (step + 1) / (warmup_steps + 1)
    if decay_type == "none":
        return 1.0
    after_warmup = max(total_steps - warmup_steps, 0)
    decay_steps = after_warmup if decay_ratio is None else round(after_warmup * decay_ratio)
    decay_start = total_steps - decay_steps
    if decay_steps <= 0 or step < decay_start:
        return 1.0
    progress = min((step - decay_start + 1) / decay_steps, 1.0)
    if decay_type == "linear":
        frac = 1.0 - progress
    elif decay_type == "cosine":
        frac = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif decay_type == "sqrt":
        frac = 1.0 - math.sqrt(progress)
    else:
        raise ValueError(f"unknown lr_scheduler.decay_type={decay_type!r}; use one of {DECAY_TYPES}")
    return min_lr_factor + (1.0 - min_lr_factor) * frac


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    total_steps: int,
    *,
    warmup_steps: int | None = None,
    warmup_fraction: float = 0.2,
    decay_ratio: float | None = None,
    decay_type: str = "cosine",
    min_lr_factor: float = 0.0,
) -> LambdaLR:
    """LambdaLR over ``optimizer`` for a run of ``total_steps`` optimizer steps; the
    ``lr_scheduler`` group's target (its keyword defaults are the group's schema).

    ``warmup_steps=None`` warms up for ``warmup_fraction`` of the run, so the default schedule
    fits a run of any length (``training.steps=5`` warms up for 1 step). ``decay_ratio``: the
    fraction of the steps after warmup spent decaying (None: all of them); the LR decays to
    ``min_lr_factor`` x the peak.
    """
    if warmup_steps is None:
        warmup_steps = round(warmup_fraction * total_steps)
    if decay_type not in DECAY_TYPES:
        raise ValueError(f"unknown lr_scheduler.decay_type={decay_type!r}; use one of {DECAY_TYPES}")
    fn = partial(
        lr_multiplier,
        total_steps=total_steps,
        warmup_steps=warmup_steps,
        decay_ratio=decay_ratio,
        decay_type=decay_type,
        min_lr_factor=min_lr_factor,
    )
    return LambdaLR(optimizer, fn)
