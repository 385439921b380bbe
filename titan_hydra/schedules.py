"""Every step schedule of a run, in one place: batch and sequence-length stages, the LR factor a
batch ramp puts on top of the LR schedule, and the LR schedules themselves (warmup -> stable ->
decay, and a cooldown branch off a stable run's checkpoint). Each is a pure function of the
optimizer step, so a run resumed at step k recomputes the same values: resuming is exact by
construction, on any layout.

**Stages.** ``training.batch_schedule`` and ``training.seq_len_schedule`` are lists of
``[tokens_seen, value]`` stages (the first at 0 tokens, both columns increasing). Walking the
steps from 0 and adding each step's tokens (global batch x seq_len) gives the tokens seen before
every step, hence the stage that step trains in: its global batch, its gradient accumulation (the
global batch over local batch x data-parallel degree: a larger batch is more micro-batches of the
same shape), its seq_len and its LR factor. Micro-batches never change shape with the batch, so
every layout (fsdp, ddp, pp, torchft) follows.

**LR factor.** ``training.batch_lr_scaling`` rescales the LR relative to the first stage's batch:
``linear`` multiplies it by B/B0 (the SGD rule), ``sqrt`` by sqrt(B/B0) (the Adam-type rule),
``none`` keeps it; ``auto`` is linear for plain SGD and sqrt for every other optimizer. The factor
is folded into the LR schedule's multipliers when the recipe builds it (``step_factor``): step s
trains at ``multiplier(s) x factor(s)``.

**LR schedules.** ``WarmupDecay`` covers warmup_cosine, warmup_linear, wsd, stable and constant:
warmup, then the peak, then a decay (linear, cosine or sqrt) over the last ``decay_ratio`` of the
steps after warmup (None: all of them). ``CooldownSchedule`` is a branch's: it starts from a
stable run's checkpoint and decays from the LR the base had there (docs/research_runs.md). Both
are the ``lr_scheduler`` group's targets: settings that build a LambdaLR over the rank's
optimizer, and whose rules (``check``) validation asks before anything is built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Optional, Sequence

import torch
from torch.optim.lr_scheduler import LambdaLR

from titan_hydra.data.settings import DataSettings
from titan_hydra.errors import ConfigError, UserError

LR_RULES = ("none", "sqrt", "linear")
DECAY_TYPES = ("linear", "cosine", "sqrt", "none")
StepFactor = Callable[[int], float]


# --------------------------------------------------------------------------- batch and seq-len stages


@dataclass(frozen=True)
class StepPlan:
    """One optimizer step: samples across the data-parallel world, micro-batches per rank, the
    window length, the LR factor on top of the LR schedule, and the tokens seen before it."""

    global_batch: int
    grad_accum: int
    seq_len: int
    lr_factor: float
    tokens_before: int


def stages_of(key: str, raw: Any) -> tuple[tuple[int, int], ...]:
    """``raw`` (a list of [tokens, value] pairs) checked: one-line ConfigError naming ``key``."""
    if raw is None:
        return ()
    try:
        stages = tuple((int(t), int(v)) for t, v in raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{key} must be a list of [tokens_seen, value] pairs, e.g. '[[0,8],[8192,16]]'; "
                          f"got {list(raw) if isinstance(raw, Sequence) else raw!r}") from None
    if not stages or stages[0][0] != 0:
        raise ConfigError(f"{key}={[list(s) for s in stages]} must start at 0 tokens seen: [[0, first], ...]")
    for (t0, v0), (t1, v1) in zip(stages, stages[1:]):
        if t1 <= t0 or v1 <= v0:
            raise ConfigError(f"{key}={[list(s) for s in stages]} must increase in both columns: stage "
                              f"[{t1}, {v1}] follows [{t0}, {v0}]")
    if stages[0][1] < 1:
        raise ConfigError(f"{key}: the first stage's value {stages[0][1]} must be >= 1")
    return stages


def lr_factor(rule: str, batch: int, first: int) -> float:
    """The LR multiplier of a step of ``batch`` samples in a ramp that starts at ``first``."""
    if rule == "none":
        return 1.0
    ratio = batch / first
    return math.sqrt(ratio) if rule == "sqrt" else ratio


def stage_value(stages: tuple[tuple[int, int], ...], tokens: int, default: int) -> int:
    """The value of the last stage whose threshold ``tokens`` has reached (``default`` without stages)."""
    value = default
    for threshold, v in stages:
        if tokens >= threshold:
            value = v
    return value


@dataclass(frozen=True)
class StepSchedule:
    """Every step's StepPlan for a local batch and data-parallel degree (no stages: the fixed plan)."""

    local: int
    data_degree: int
    global_batch: int  # without a batch schedule
    seq_len: int  # without a seq-len schedule (with one: the longest stage)
    batch_stages: tuple[tuple[int, int], ...] = ()
    seq_stages: tuple[tuple[int, int], ...] = ()
    lr_rule: str = "none"
    _table: list = field(default_factory=list, compare=False, repr=False)

    @property
    def scheduled(self) -> bool:
        return bool(self.batch_stages or self.seq_stages)

    def at(self, step: int) -> StepPlan:
        """The plan of the step after ``step`` steps were taken (0-based)."""
        table = self._table
        while len(table) <= step:
            tokens = table[-1].tokens_before + table[-1].global_batch * table[-1].seq_len if table else 0
            table.append(self._plan(tokens))
        return table[step]

    def _plan(self, tokens: int) -> StepPlan:
        batch = stage_value(self.batch_stages, tokens, self.global_batch)
        first = self.batch_stages[0][1] if self.batch_stages else batch
        return StepPlan(batch, batch // (self.local * self.data_degree), stage_value(self.seq_stages, tokens, self.seq_len),
                        lr_factor(self.lr_rule, batch, first), tokens)

    @property
    def step_factor(self) -> Optional[StepFactor]:
        """The LR factor of each step for the LR schedule to fold in; None where it is 1 throughout
        (no batch stages, or ``training.batch_lr_scaling=none``)."""
        if not self.batch_stages or self.lr_rule == "none":
            return None
        return self.lr_factor_at

    def lr_factor_at(self, step: int) -> float:
        return self.at(step).lr_factor

    def check_layout(self, dims: Any, data: DataSettings) -> None:
        """The stages on this layout and data, one line each: a batch schedule counts tokens seen,
        which token data has; a seq-len schedule's shorter stages keep the rules ``training.seq_len``
        (the longest) keeps, on packed data and a layout that can change window length between steps.
        ``dims`` is the run's ParallelDims (``parallelism=auto`` asks this of every candidate)."""
        if self.batch_stages and not data.token_data:
            raise ConfigError("training.batch_schedule counts tokens seen (sequences x seq_len), which data of "
                              f"{data.name!r} has not: drop the schedule or use token data")
        if not self.seq_stages:
            return
        if not data.packed:
            raise ConfigError("training.seq_len_schedule needs packed token data (one source, data.streaming=false; "
                              "not a mixture, streamed or image data): drop the schedule or change data")
        if dims.pp > 1:
            raise ConfigError(f"training.seq_len_schedule is not supported with parallelism.pp={dims.pp} (a pipeline's "
                              "stages are built for one micro-batch shape); use pp=1 or drop the schedule")
        for _, s in self.seq_stages:
            if (dims.cp > 1 and s % (2 * dims.cp)) or (dims.tp_sequence_parallel and s % (dims.tp * dims.cp)):
                raise ConfigError(f"training.seq_len_schedule stage seq_len {s} must be divisible by 2*cp={2 * dims.cp} "
                                  f"and tp*cp={dims.tp * dims.cp} under sequence parallel; change that stage")

    @property
    def max_global_batch(self) -> int:
        return max([self.global_batch] + [v for _, v in self.batch_stages])

    @property
    def max_grad_accum(self) -> int:
        return self.max_global_batch // (self.local * self.data_degree)

    def describe(self) -> str:
        """The run header's line: the stages and the LR rule."""
        parts = []
        if self.batch_stages:
            ramp = " -> ".join(f"{v} (from {t} tokens)" for t, v in self.batch_stages)
            parts.append(f"batch ramp {ramp}, LR x {self.lr_rule}(B/{self.batch_stages[0][1]})")
        if self.seq_stages:
            parts.append("seq_len " + " -> ".join(f"{v} (from {t} tokens)" for t, v in self.seq_stages))
        return "; ".join(parts)


def resolve_lr_rule(rule: str, optimizer_target: str) -> str:
    """``auto``: linear for plain SGD (its update is proportional to the gradient), sqrt otherwise."""
    if rule != "auto":
        return rule
    return "linear" if optimizer_target.rsplit(".", 1)[-1] == "SGD" else "sqrt"


def check_batch_stages(stages: tuple[tuple[int, int], ...], local: int, data_degree: int) -> None:
    """Every stage's global batch a whole number of local batches on every data-parallel rank."""
    per_step = local * data_degree
    for threshold, batch in stages:
        if batch % per_step:
            raise ConfigError(f"training.batch_schedule stage [{threshold}, {batch}]: {batch} is not a multiple of "
                              f"local_batch_size {local} x data-parallel degree {data_degree} = {per_step}; "
                              "make every stage's batch a multiple of it")


def schedule_of(local: int, data_degree: int, global_batch: int, seq_len: int, batch_schedule: Any,
                seq_len_schedule: Any, lr_rule: str, configured_global: int = -1) -> StepSchedule:
    """The StepSchedule of the training settings, its stages refused in one line where they cannot
    run. ``configured_global``: ``training.global_batch_size`` as given (-1: derived)."""
    batch_stages = stages_of("training.batch_schedule", batch_schedule)
    seq_stages = stages_of("training.seq_len_schedule", seq_len_schedule)
    check_batch_stages(batch_stages, local, data_degree)
    if batch_stages and configured_global > 0 and configured_global != batch_stages[0][1]:
        raise ConfigError(f"training.global_batch_size={configured_global} but training.batch_schedule starts at "
                          f"{batch_stages[0][1]}: the schedule sets every step's batch, set training.global_batch_size=-1")
    if seq_stages and seq_stages[-1][1] != seq_len:
        raise ConfigError(f"training.seq_len_schedule ends at seq_len {seq_stages[-1][1]} but training.seq_len="
                          f"{seq_len}: set training.seq_len={seq_stages[-1][1]} (the longest stage: the model, "
                          "validation and the planner are sized for it)")
    if lr_rule not in LR_RULES:
        raise ConfigError(f"training.batch_lr_scaling={lr_rule!r}; choose one of auto, {', '.join(LR_RULES)}")
    return StepSchedule(local, data_degree, global_batch, seq_len, batch_stages, seq_stages, lr_rule)


# --------------------------------------------------------------------------- LR schedules


def lr_multiplier(step: int, *, total_steps: int, warmup_steps: int, decay_ratio: float | None, decay_type: str,
                  min_lr_factor: float) -> float:
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


def scaled(fn: Callable[[int], float], step_factor: Optional[StepFactor]) -> Callable[[int], float]:
    """``fn`` times the step's LR factor (``fn`` itself without one). A plain function: LambdaLR's
    state_dict saves no function, only ``last_epoch``, so a checkpoint is the same either way."""
    if step_factor is None:
        return fn

    def with_factor(step: int) -> float:
        return fn(step) * step_factor(step)
    return with_factor


def _check_decay_type(decay_type: str) -> None:
    if decay_type not in DECAY_TYPES:
        raise ValueError(f"unknown lr_scheduler.decay_type={decay_type!r}; use one of {DECAY_TYPES}")


def _check_floor(min_lr_factor: float) -> None:
    if not 0.0 <= min_lr_factor <= 1.0:
        raise ConfigError(f"lr_scheduler.min_lr_factor={min_lr_factor} must be within [0, 1]")


@dataclass(frozen=True)
class WarmupDecay:
    """Linear warmup -> stable -> decay: the ``lr_scheduler`` group's target (every option but
    cooldown; its defaults are the group's schema), called by the recipe with the optimizer and
    ``training.steps``.

    ``warmup_steps=None`` warms up for ``warmup_fraction`` of the run, so the default schedule fits
    a run of any length (``training.steps=5`` warms up for 1 step). ``decay_ratio``: the fraction
    of the steps after warmup spent decaying (None: all of them); the LR decays to
    ``min_lr_factor`` x the peak."""

    warmup_steps: Optional[int] = None
    warmup_fraction: float = 0.2
    decay_ratio: Optional[float] = None
    decay_type: str = "cosine"
    min_lr_factor: float = 0.0

    def __post_init__(self) -> None:
        _check_decay_type(self.decay_type)

    def check(self, total_steps: int) -> None:
        """The settings against the run's length, one line each (before anything is built)."""
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ConfigError(f"lr_scheduler.warmup_steps={self.warmup_steps} must be >= 0")
        _check_floor(self.min_lr_factor)
        if not 0.0 <= self.warmup_fraction <= 1.0:
            raise ConfigError(f"lr_scheduler.warmup_fraction={self.warmup_fraction} must be within [0, 1]")
        if self.warmup_steps is not None and self.warmup_steps > total_steps:
            raise ConfigError(
                f"lr_scheduler.warmup_steps={self.warmup_steps} exceeds training.steps={total_steps}; lower it or set "
                "lr_scheduler.warmup_steps=null (warmup_fraction of the run)"
            )
        if self.decay_ratio is not None and not 0.0 <= self.decay_ratio <= 1.0:
            raise ConfigError(f"lr_scheduler.decay_ratio={self.decay_ratio} must be within [0, 1]")

    def __call__(self, optimizer: torch.optim.Optimizer, total_steps: int,
                 step_factor: Optional[StepFactor] = None) -> LambdaLR:
        """LambdaLR over ``optimizer`` for a run of ``total_steps`` optimizer steps, each step's
        multiplier times ``step_factor(step)`` where one is given."""
        warmup = round(self.warmup_fraction * total_steps) if self.warmup_steps is None else self.warmup_steps
        fn = partial(lr_multiplier, total_steps=total_steps, warmup_steps=warmup, decay_ratio=self.decay_ratio,
                     decay_type=self.decay_type, min_lr_factor=self.min_lr_factor)
        return LambdaLR(optimizer, scaled(fn, step_factor))


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


def check_branch_point(step: int, total_steps: int, where: str = "") -> None:
    """A cooldown decays from its branch point to ``training.steps``: the point must come first."""
    of = f" of {where}" if where else ""
    if step >= total_steps:
        raise ConfigError(f"lr_scheduler=cooldown: the branch point (step {step}{of}) is not before training.steps="
                          f"{total_steps}; set training.steps to the branch point + the cooldown steps")


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
    """A LambdaLR of ``Cooldown`` multipliers (times the step factor, where one is given): loading a
    base run's checkpoint (its lambdas carry no branch point) starts the branch there, from the
    base's LR at that step relative to its peak. It keeps its own ``Cooldown`` objects: the branch
    point and start are the cooldown's, not the step factor's."""

    def __init__(self, optimizer: torch.optim.Optimizer, cooldowns: list[Cooldown],
                 step_factor: Optional[StepFactor] = None) -> None:
        self._cooldowns = list(cooldowns)
        super().__init__(optimizer, [scaled(fn, step_factor) for fn in cooldowns])

    def state_dict(self) -> dict:
        state = {k: v for k, v in super().state_dict().items() if k != "_cooldowns"}
        state["lr_lambdas"] = [{"branch_step": fn.branch_step, "start_factor": fn.start_factor}
                               for fn in self._cooldowns]
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        saved = [fn or {} for fn in state_dict.get("lr_lambdas") or []]
        if saved and all(s.get("branch_step") is not None for s in saved):  # this branch's own checkpoint
            for fn, s in zip(self._cooldowns, saved):
                fn.branch_step, fn.start_factor = int(s["branch_step"]), float(s["start_factor"])
        else:
            self._branch_off(state_dict)
        # the saved LRs are the base's: the next step's are this schedule's
        step = int(state_dict["last_epoch"])
        lrs = [peak * fn(step) for peak, fn in zip(state_dict["base_lrs"], self.lr_lambdas)]
        super().load_state_dict({**state_dict, "lr_lambdas": [None] * len(self.lr_lambdas), "_last_lr": lrs})
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr

    def _branch_off(self, state_dict: dict) -> None:
        """Start the cooldown at a base run's step, from its multiplier there (LR / peak, per group),
        less the step factor at that step (it applies to both runs)."""
        step = int(state_dict["last_epoch"])
        check_branch_point(step, self._cooldowns[0]._shape[0])
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

    def __post_init__(self) -> None:
        _check_decay_type(self.decay_type)

    def check(self, total_steps: int) -> None:
        """The settings' own rule (where it branches is validation's, from the checkpoint settings)."""
        _check_floor(self.min_lr_factor)

    def __call__(self, optimizer: torch.optim.Optimizer, total_steps: int,
                 step_factor: Optional[StepFactor] = None) -> CooldownLR:
        return CooldownLR(optimizer, [Cooldown(total_steps, self.decay_type, self.min_lr_factor)
                                      for _ in optimizer.param_groups], step_factor)


LRSchedule = WarmupDecay | CooldownSchedule  # the lr_scheduler group's targets
