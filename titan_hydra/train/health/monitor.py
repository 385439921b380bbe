"""``HealthMonitor``: what the training loop calls, wiring the guard, rollback, straggler check,
watchdog and injected faults of one rank.

The loop's calls, per step: ``begin_step`` (faults, watchdog beat, clock), ``judge`` (after the
loss and gradient norm are reduced: apply the step or skip it; rolls back when too many were
skipped in a row), ``recheck_step`` (on a recheck step, before the gradients are used: re-run and compare them),
``end_step`` (after an applied step: straggler gather and replica comparison when due). Events print
one ``health:`` line on rank 0 and log ``health/*`` metrics (files, TensorBoard, W&B); the run's
summary counts them (``summary``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

import torch

from titan_hydra.train.health.guard import StepGuard
from titan_hydra.train.health.inject import Injector
from titan_hydra.train.health.recheck import GradRecheck
from titan_hydra.train.health.rollback import Rollback
from titan_hydra.train.health.sdc import ReplicaCheck
from titan_hydra.config.fault_injection import FaultInjection
from titan_hydra.config.health import Health
from titan_hydra.train.health.stragglers import StepClock, StragglerCheck
from titan_hydra.train.health.watchdog import HANG_DIR, Watchdog


class HealthMonitor:
    """One rank's health checks. ``checkpointer``, ``loader`` and ``state`` are what a rollback
    restores and moves; ``metric_logger`` takes the ``health/*`` metrics (rank 0 writes them);
    ``restart`` is what the hang watchdog's reporting rank calls (``Watchdog``)."""

    def __init__(self, settings: Health, faults: FaultInjection, *, run_dir: str, rank: int, world_size: int,
                 device: torch.device, parts: list, checkpointer: Any, loader: Any, state: Any,
                 metric_logger: Any, dims: Any = None, restart: Callable[[], str] | None = None) -> None:
        self.settings, self.rank, self.parts, self.state = settings, rank, parts, state
        self.report = Path(run_dir) / "health" / f"rank{rank}.json"  # this rank's counts and events
        self.metric_logger = metric_logger
        self.injector = Injector(faults, rank, Path(run_dir) / HANG_DIR, Path(run_dir))
        self.guard = StepGuard(skip_nonfinite=settings.skip_nonfinite, spike_window=settings.spike_window,
                               spike_min_history=settings.spike_min_history, spike_k=settings.spike_k,
                               spike_action=settings.spike_action)
        self.rollback = Rollback(checkpointer, loader, state, run_dir, rank, settings.max_rollbacks)
        self.replicas = ReplicaCheck(settings.checksum_every if settings.enable else 0, settings.checksum_action,
                                     dims, device)
        self.recheck = GradRecheck(settings.recheck_every if settings.enable else 0, settings.recheck_action,
                                   device, self.injector.corrupt_grads)
        self.stragglers = StragglerCheck(settings.straggler_every if settings.enable else 0, settings.straggler_ratio,
                                         rank, world_size, device)
        on = settings.enable and settings.hang_timeout_s > 0
        self.watchdog = Watchdog(settings.hang_timeout_s, run_dir, rank, world_size, restart) if on else None
        self.clock = StepClock()
        self.own_s = 0.0  # time spent in this monitor outside the gathers: its per-step cost
        self.events: list[str] = []

    def say(self, line: str) -> None:
        self.events.append(line)
        if self.rank == 0:
            print(f"health: {line}", flush=True)

    def start(self) -> None:
        if self.watchdog is not None:
            self.watchdog.start(self.state.step)

    def close(self) -> None:
        """Stop the watchdog; write this rank's counts and events (every rank: they must agree)."""
        if self.watchdog is not None:
            self.watchdog.stop()
        self.report.parent.mkdir(parents=True, exist_ok=True)
        self.report.write_text(json.dumps({**self.summary(), "step": self.state.step, "event_lines": self.events}))

    def begin_step(self, step: int) -> None:
        self.clock.start()
        self.recheck.begin_step(step)
        self.injector.begin_step(step, self.parts)  # before the beat: a hung rank's last beat is the step before
        if self.watchdog is not None:
            self.watchdog.beat(step, "forward/backward")

    def recheck_step(self, step: int, params: list, rerun: Callable[[], object]) -> None:
        """A due step's gradients against a re-run of its micro-batches (``rerun``), before they are used."""
        buffers = [b for part in self.parts for b in part.buffers()]
        metrics, line = self.recheck.check(step, params, rerun, buffers)
        self.metric_logger.log(metrics, step)
        if line:
            self.say(line)

    def judge(self, loss: float, grad_norm: float) -> bool:
        """Whether to apply this step (the same answer on every rank: both values are reduced)."""
        t0 = time.perf_counter()
        self.injector.end_step()
        if not self.settings.enable:
            return True  # health=off: a non-finite loss stops the run, as it always did
        step = self.state.step + 1
        if self.watchdog is not None:
            self.watchdog.beat(step, "optimizer")
        verdict = self.guard.judge(loss, grad_norm)
        if verdict.reason:
            action = "applied" if verdict.apply else "skipped (optimizer and schedule untouched)"
            self.say(f"step {step} {verdict.reason}: {verdict.detail}; {action}")
            self.metric_logger.log({"health/skipped": self.guard.skipped, "health/spikes": self.guard.spikes,
                                    "health/skipped_in_a_row": self.guard.in_a_row}, step)
        if not verdict.apply and self.guard.in_a_row >= max(self.settings.max_skips_in_a_row, 1):
            self.say(self.rollback(verdict.detail, self.guard.in_a_row, verdict.reason))
            self.guard.reset_in_a_row()
            self.metric_logger.log({"health/rollbacks": self.rollback.done}, self.state.step)
        self.own_s += time.perf_counter() - t0
        return verdict.apply

    def end_step(self, step: int) -> None:
        """After an applied step (all ranks): its time, and the straggler gather when due."""
        t0 = time.perf_counter()
        self.stragglers.add(*self.clock.stop())
        if self.watchdog is not None:
            self.watchdog.beat(step, "done")
        self.own_s += time.perf_counter() - t0
        self.injector.after_step(step, self.parts)
        checks = [(self.stragglers.due(step), lambda: self.stragglers.gather(step)),
                  (self.replicas.due(step), lambda: self.replicas.check(step, self.parts))]
        for due, check in checks:
            if due:
                metrics, line = check()
                self.metric_logger.log(metrics, step)
                if line:
                    self.say(line)

    def take_straggler_wait(self) -> float:
        """Seconds the fastest rank waited on the slowest over the windows gathered since the last take."""
        waited, self.stragglers.waited_s = self.stragglers.waited_s, 0.0
        return waited

    def summary(self) -> dict[str, Any]:
        """Counts for the run's end summary, and what the checks cost (seconds over the run)."""
        return {"skipped": self.guard.skipped, "spikes": self.guard.spikes, "rollbacks": self.rollback.done,
                "events": len(self.events), "cost_s": self.own_s + self.stragglers.gather_s,
                "recheck_mismatches": self.recheck.mismatches, "recheck_s": self.recheck.seconds}
