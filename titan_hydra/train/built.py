"""What the recipe builds for one rank and hands to the loop, as whole objects.

The loop (``trainer.py``) receives these few objects instead of their two dozen parts, so a new
piece of a run is one field here and one line where the recipe builds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from titan_hydra.kernels.attention_policy import KernelChoice
from titan_hydra.train.nulls import NoEMA, NoGoodput


@dataclass(frozen=True)
class DataPlan:
    """The dataset and this rank's loaders."""

    dataset: Any
    train_loader: Any
    val_loader_factory: Callable[[], Any]
    # a mixture's sources, each with its own held-out split: name -> loader factory (val/<name>/loss)
    source_val_factories: dict[str, Callable[[], Any]] = field(default_factory=dict)
    # (seq_len, tokens seen before the step) -> None: a seq-len schedule's loader switches stage
    stage: Callable[[int, int], None] = lambda seq_len, tokens_before: None


@dataclass(frozen=True)
class BuiltModel:
    """This rank's model after its layout was applied and its weights initialized."""

    family: Any  # titan_hydra.models.protocol.ModelFamily
    args: Any
    parts: list[torch.nn.Module]  # this rank's model (or pipeline stages)
    runner: Any  # forward_backward / eval_loss for this layout
    float8: Any
    flops_per_unit: float  # per token, or per whatever the family's objective counts
    attention_dtype: Any = None  # the dtype SDPA runs in (None: the compute dtype)
    # what runs plain causal attention, and why (kernels/attention_policy.py)
    attention_kernel: KernelChoice = KernelChoice("sdpa", "set explicitly")
    # per-step metrics of the training loss's own terms (``mtp/loss``; train/mtp_metrics.py)
    loss_hooks: list = field(default_factory=list)
    # what runs Gated DeltaNet layers, and why (kernels/gated_delta_policy.py); None: the model has none
    delta_kernel: KernelChoice | None = None
    # {parameter FQN: Geometry} of the width parametrization (models/parametrization.py); {} = sp
    geometry: dict = field(default_factory=dict)
    # model-internal losses' weight (a MoE's aux loss) given the runner's loss scale; None: none
    reweigh: Callable[[float], None] | None = None

    def set_accumulation(self, grad_accum: int) -> None:
        """Micro-batches of the coming step: the runner's loss scaling and what weighs like it."""
        self.runner.set_grad_accum(grad_accum)
        if self.reweigh is not None:
            self.reweigh(self.runner.loss_scale)

    @property
    def objective(self):
        return self.family.objective


@dataclass(frozen=True)
class Schedule:
    """How many steps, and what happens every how many of them; ``plan.at(step)`` is each
    step's batch, accumulation and seq_len (titan_hydra/schedules.py: fixed without a schedule)."""

    steps: int
    grad_accum_steps: int
    max_norm: float
    log_freq: int
    val_freq: int
    val_steps: int
    plan: Any = None  # titan_hydra.schedules.StepSchedule


@dataclass(frozen=True)
class Monitors:
    """Where a step's numbers go and what measures them."""

    metric_logger: Any
    throughput: Any
    memory: Any
    profiler: Any = None


@dataclass(frozen=True)
class BoundEval:
    """The ``eval`` group's evaluator with the model and data it evaluates: ``due`` / ``run``."""

    evaluator: Any  # titan_hydra.train.eval.PeriodicEval
    model: BuiltModel
    dataset: Any
    dims: Any = None  # ParallelDims: where this rank's slice of a sharded evaluation is

    def due(self, step: int, last: bool) -> bool:
        return self.evaluator.due(step, last)

    def run(self, step: int, last: bool) -> tuple[dict[str, float], dict[str, tuple[np.ndarray, list[str]]]]:
        return self.evaluator.run(self.model.parts, self.model.family, self.model.args, self.dataset, step, last,
                                  dims=self.dims, runner=self.model.runner)


@dataclass(frozen=True)
class Optimization:
    """The optimizer over this rank's parameters and its LR schedule."""

    optimizer: Any
    lr_scheduler: Any


@dataclass(frozen=True)
class Placement:
    """Where this rank runs: its rank, its device and the layout it is one rank of."""

    rank: int
    device: torch.device
    dims: Any  # titan_hydra.parallel.parallelism.ParallelDims


@dataclass(frozen=True)
class Services:
    """What runs around the loop's steps. The optional ones (periodic eval, fault tolerance,
    health, preemption) are null objects when off (``train/nulls.py``), with the same methods."""

    monitors: Monitors
    checkpointer: Any  # titan_hydra.checkpoint.CheckpointManager
    periodic_eval: Any  # BoundEval or NoEval
    fault_tolerance: Any  # runtime.fault_tolerance.FaultTolerance or NoFaultTolerance
    health: Any  # train.health.monitor.HealthMonitor or NoHealth
    preemption: Any  # runtime.preemption.Preemption or NoPreemption
    # per-optimizer-step work returning metrics (the family's, e.g. MoE load balancing; compile's)
    step_hooks: tuple = ()
    # the EMA of the weights (train/ema.py's WeightEMA), NoEMA when training.ema_decay=0
    ema: Any = field(default_factory=NoEMA)
    # the run's goodput ledger (metrics/goodput_ledger.py), NoGoodput for a loop outside a run
    goodput: Any = field(default_factory=NoGoodput)
