"""A batch schedule's LR rescaling, on top of whatever the ``lr_scheduler`` group built.

The group's LambdaLR stays as it is (its multiplier is its own module's pure function of the
step); each of its lambdas is wrapped so that step s trains at ``lambda(s) x lr_factor(s)``, the
factor of the global batch the batch schedule gives step s (config/schedules.py). Both are pure
functions of the step, so the LR of a resumed run is the uninterrupted run's, bit for bit. The
wrappers are plain functions: LambdaLR's state_dict saves no function, only ``last_epoch``.
"""

from __future__ import annotations

from typing import Any, Callable

from titan_hydra.config.schedules import StepSchedule
from titan_hydra.errors import ConfigError


def _scaled(fn: Callable[[int], float], plan: StepSchedule) -> Callable[[int], float]:
    def scaled(step: int) -> float:
        return fn(step) * plan.at(step).lr_factor
    return scaled


def with_batch_lr(lr_scheduler: Any, plan: StepSchedule | None) -> Any:
    """``lr_scheduler`` with the batch schedule's LR factor (unchanged without a batch schedule or
    with ``training.batch_lr_scaling=none``); the current LR reset to step ``last_epoch``'s."""
    if plan is None or not plan.batch_stages or plan.lr_rule == "none":
        return lr_scheduler
    if not hasattr(lr_scheduler, "lr_lambdas"):
        raise ConfigError(f"training.batch_lr_scaling={plan.lr_rule} rescales a LambdaLR's multiplier, but the "
                          f"lr_scheduler group built a {type(lr_scheduler).__name__}; set training.batch_lr_scaling=none")
    lr_scheduler.lr_lambdas = [_scaled(fn, plan) for fn in lr_scheduler.lr_lambdas]
    groups = lr_scheduler.optimizer.param_groups
    for group, base, fn in zip(groups, lr_scheduler.base_lrs, lr_scheduler.lr_lambdas):
        group["lr"] = base * fn(lr_scheduler.last_epoch)
    lr_scheduler._last_lr = [group["lr"] for group in groups]
    return lr_scheduler
