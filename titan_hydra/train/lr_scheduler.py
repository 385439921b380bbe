"""Learning-rate schedules: linear warmup -> stable -> decay (linear, cosine or sqrt).

One function covers the `lr_scheduler` group's options: warmup_cosine and warmup_linear decay
over everything after warmup (``decay_ratio=None``), wsd keeps the peak until the last
``decay_ratio`` of training, constant has neither. The multiplier is a pure function of the
step, wrapped in a LambdaLR so its state checkpoints with the rest of the run.

``lr_scheduler=cooldown`` (``CooldownSchedule``) is a branch's schedule: it starts from a
stable run's checkpoint and decays from the LR the base had there (docs/research_runs.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import torch
from torch.optim.lr_scheduler import LambdaLR

from titan_hydra.errors import UserError

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


# --------------------------------------------------------------------------- cooldown branches


def cooldown_multiplier(step: int, *, branch_step: int, start_factor: float, total_steps: int,
                        decay_type: str, min_lr_factor: float) -> float:
    """Multiplier of the peak LR for optimizer step ``step`` (0-based) of a branch that leaves its
    base run at ``branch_step`` with the base's multiplier ``start_factor`` and reaches
    ``min_lr_factor`` at ``total_steps``. Written as wsd's decay is (progress counted from the
    first decayed step, ``+ 1``), so a branch off a constant run equals an uninterrupted wsd run."""
    if step < branch_step:
        return start_factor
    # the share of the drop still ahead: a decay over the whole branch, from 1 to 0
    ahead = lr_multiplier(step - branch_step, total_steps=total_steps - branch_step, warmup_steps=0,
                          decay_ratio=None, decay_type=decay_type, min_lr_factor=0.0)
    return min_lr_factor + (start_factor - min_lr_factor) * ahead


class Cooldown:
    """One param group's cooldown multiplier. Its branch point and start factor are learned from
    the checkpoint it branches off (``CooldownLR.load_state_dict``) and are its whole saved state
    (LambdaLR saves a callable object's ``__dict__``), so a preempted branch resumes its own decay."""

    def __init__(self, total_steps: int, decay_type: str, min_lr_factor: float) -> None:
        self.branch_step: int | None = None
        self.start_factor: float | None = None
        self._shape = (total_steps, decay_type, min_lr_factor)  # this run's settings: not saved

    def __call__(self, step: int) -> float:
        if self.branch_step is None:
            if step == 0:  # LambdaLR's first evaluation, before the checkpoint is loaded
                return 1.0
            raise UserError("lr_scheduler=cooldown branches off a checkpoint of a stable run, and none was loaded: "
                            "set checkpoint.initial_load_path=<base run>/checkpoint/step-N")
        total, decay_type, floor = self._shape
        return cooldown_multiplier(step, branch_step=self.branch_step, start_factor=self.start_factor,
                                   total_steps=total, decay_type=decay_type, min_lr_factor=floor)


class CooldownLR(LambdaLR):
    """A LambdaLR of ``Cooldown`` multipliers: loading a base run's checkpoint (its lambdas carry
    no branch point) starts the branch there, from the base's LR at that step relative to its peak.

    It keeps its own ``Cooldown`` objects (``_cooldowns``): other code may wrap the lambdas
    (a batch schedule's LR factor, a pure function of the step on top of any schedule), and the
    branch point and start are the cooldown's, not the wrapper's."""

    def __init__(self, optimizer: torch.optim.Optimizer, cooldowns: list[Cooldown]) -> None:
        self._cooldowns = list(cooldowns)
        super().__init__(optimizer, list(cooldowns))

    def state_dict(self) -> dict:
        state = {k: v for k, v in super().state_dict().items() if k != "_cooldowns"}
        state["lr_lambdas"] = [{"branch_step": fn.branch_step, "start_factor": fn.start_factor}
                               for fn in self._cooldowns]
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        saved = [fn or {} for fn in state_dict.get("lr_lambdas") or []]
        super().load_state_dict({**state_dict, "lr_lambdas": [None] * len(self.lr_lambdas)})
        if saved and all(s.get("branch_step") is not None for s in saved):  # this branch's own checkpoint
            for fn, s in zip(self._cooldowns, saved):
                fn.branch_step, fn.start_factor = int(s["branch_step"]), float(s["start_factor"])
        else:
            self._branch_off(state_dict)
        # the saved LRs are the base's: the next step's are this schedule's
        self._last_lr = [peak * fn(self.last_epoch) for peak, fn in zip(self.base_lrs, self.lr_lambdas)]
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr

    def _branch_off(self, state_dict: dict) -> None:
        """Start the cooldown at a base run's step, from its multiplier there (LR / peak, per group),
        less any factor a wrapper of the lambdas applies at that step (it applies it to both runs)."""
        step = int(state_dict["last_epoch"])
        total = self._cooldowns[0]._shape[0]
        if step >= total:
            raise UserError(f"lr_scheduler=cooldown: the branch point (step {step}) is not before training.steps="
                            f"{total}; set training.steps to the branch point plus the cooldown steps")
        ratios = [lr / peak for lr, peak in zip(state_dict["_last_lr"], state_dict["base_lrs"])]
        for fn, outer, ratio in zip(self._cooldowns, self.lr_lambdas, ratios):
            fn.branch_step, fn.start_factor = step + 1, 1.0  # (a multiplier of 1 at the step: outer's own factor)
            fn.branch_step, fn.start_factor = step, ratio / outer(step)


@dataclass(frozen=True)
class CooldownSchedule:
    """A cooldown branch (``lr_scheduler=cooldown``'s target; the recipe calls it with the optimizer
    and ``training.steps``): from the checkpoint the run starts from (step S of a stable run,
    ``checkpoint.initial_load_path``), the LR goes from the base's value at S down to
    ``min_lr_factor`` x the peak at ``total_steps`` (so the cooldown lasts ``training.steps - S``
    steps), in the shape ``decay_type`` (sqrt: WSD's 1-sqrt).

    Why its own schedule rather than wsd: a branch knows neither where it starts nor the base's LR
    there until the checkpoint is loaded, and it must not retrain the base's steps to get there.
    """

    decay_type: str = "sqrt"
    min_lr_factor: float = 0.0
    branches_off_a_checkpoint: ClassVar[bool] = True  # validate's cue (it cannot import this layer)

    def __post_init__(self) -> None:
        if self.decay_type not in DECAY_TYPES:
            raise ValueError(f"unknown lr_scheduler.decay_type={self.decay_type!r}; use one of {DECAY_TYPES}")

    def __call__(self, optimizer: torch.optim.Optimizer, total_steps: int) -> CooldownLR:
        return CooldownLR(optimizer, [Cooldown(total_steps, self.decay_type, self.min_lr_factor)
                                      for _ in optimizer.param_groups])
