"""Batch-size and sequence-length schedules: every step's plan as a pure function of the step.

``training.batch_schedule`` and ``training.seq_len_schedule`` are lists of ``[tokens_seen, value]``
stages (the first at 0 tokens, both columns increasing). Walking the steps from 0 and adding each
step's tokens (global batch x seq_len) gives the tokens seen before every step, hence the stage
that step trains in: its global batch, its gradient accumulation (the global batch over local
batch x data-parallel degree: a larger batch is more micro-batches of the same shape), its
seq_len and its LR factor. Nothing of it is state: a run resumed at step k recomputes the same
table, so resuming mid-ramp is exact by construction, and every layout (fsdp, ddp, pp, torchft)
follows because micro-batches never change shape with the batch.

LR rescaling (``training.batch_lr_scaling``) is relative to the first stage's batch: ``linear``
multiplies the LR by B/B0 (the SGD rule), ``sqrt`` by sqrt(B/B0) (the Adam-type rule), ``none``
keeps it; ``auto`` is linear for plain SGD and sqrt for every other optimizer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from titan_hydra.errors import ConfigError

LR_RULES = ("none", "sqrt", "linear")


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
                seq_len_schedule: Any, lr_rule: str) -> StepSchedule:
    """The StepSchedule of the training settings, its stages refused in one line where they cannot run."""
    batch_stages = stages_of("training.batch_schedule", batch_schedule)
    seq_stages = stages_of("training.seq_len_schedule", seq_len_schedule)
    check_batch_stages(batch_stages, local, data_degree)
    if seq_stages and seq_stages[-1][1] != seq_len:
        raise ConfigError(f"training.seq_len_schedule ends at seq_len {seq_stages[-1][1]} but training.seq_len="
                          f"{seq_len}: set training.seq_len={seq_stages[-1][1]} (the longest stage: the model, "
                          "validation and the planner are sized for it)")
    if lr_rule not in LR_RULES:
        raise ConfigError(f"training.batch_lr_scaling={lr_rule!r}; choose one of auto, {', '.join(LR_RULES)}")
    return StepSchedule(local, data_degree, global_batch, seq_len, batch_stages, seq_stages, lr_rule)
