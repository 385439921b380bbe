"""The training loop: one loop for every parallel layout.

Everything layout-specific arrives already built: the model parts (one module, or this rank's
pipeline stages), the runner that runs a microbatch on them (single stage or pipeline; it also
owns the per-step context: autocast, loss parallel, context-parallel sharding) and
ParallelDims for reductions. The loop itself only
accumulates gradients, clips, steps, validates, logs and checks the loss is finite.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from titan_hydra.errors import TrainingDiverged
from titan_hydra.metrics.memory import state_memory_gib
from titan_hydra.train.built import BuiltModel, DataPlan, Optimization, Placement, Schedule, Services
from titan_hydra.train.grad_clip import clip_grad_norm_


def to_device(batch: Any, device: torch.device) -> Any:
    """A tensor, or a dict of tensors (a batch of keyword inputs), on ``device``."""
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch.to(device, non_blocking=True) if isinstance(batch, torch.Tensor) else batch


@dataclass
class TrainState:
    """Progress that a checkpoint must carry besides model/optimizer/data. ``seen`` counts the
    objective's units (tokens for language models, images for an image objective)."""

    step: int = 0
    seen: int = 0
    losses: list[float] = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "seen": self.seen, "losses": list(self.losses)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = int(sd["step"])
        self.seen = int(sd["seen"] if "seen" in sd else sd["tokens_seen"])  # checkpoints before the rename
        self.losses = [float(x) for x in sd.get("losses", [])]


class Trainer:
    """The loop. ``model.runner`` (``parallel/runner.py`` or ``parallel/pp.py``) runs each
    microbatch for whatever layout this rank has; ``services`` holds the checkpointer (holding
    ``state``), the monitors and the optional services (periodic eval, torchft's quorum /
    gradient average / commit around each step, the health checks, a SLURM preemption watcher),
    which are null objects when off."""

    def __init__(self, *, model: BuiltModel, optim: Optimization, data: DataPlan, schedule: Schedule,
                 services: Services, state: TrainState, where: Placement) -> None:
        self.model, self.data, self.schedule, self.state = model, data, schedule, state
        self.optimizer, self.lr_scheduler = optim.optimizer, optim.lr_scheduler
        self.rank, self.dims, self.device = where.rank, where.dims, where.device
        self.monitors, self.checkpointer, self.step_hooks = services.monitors, services.checkpointer, services.step_hooks
        self.periodic_eval, self.fault_tolerance = services.periodic_eval, services.fault_tolerance
        self.health, self.preemption, self.ema = services.health, services.preemption, services.ema
        self.goodput = services.goodput  # where the wall time goes (metrics/goodput_ledger.py)
        self.steps = schedule.steps  # a seed-checkpoint run sets it to 0
        self._accum = schedule.grad_accum_steps  # what the runner was built with
        self.last_val_loss: float | None = None

    # --- one microbatch -------------------------------------------------------------
    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Forward + backward of one microbatch; returns its (local) mean loss, detached."""
        return self.model.runner.forward_backward(to_device(inputs, self.device), to_device(labels, self.device))

    def begin_plan(self) -> Any:
        """This step's plan (titan_hydra/schedules.py: fixed without a schedule): the runner's loss
        scaling follows its micro-batch count, the loader its seq_len stage."""
        plan = self.schedule.plan.at(self.state.step)
        if plan.grad_accum != self._accum:
            self.model.set_accumulation(plan.grad_accum)
            self._accum = plan.grad_accum
        self.data.stage(plan.seq_len, plan.tokens_before)
        return plan

    def accumulate(self, grad_accum: int) -> tuple[list[torch.Tensor], int, float]:
        """The step's micro-batches forward and backward: (their losses, units, data seconds). On a
        recheck step the health monitor runs the same micro-batches again and compares the gradients."""
        step = self.state.step + 1
        recheck = self.health.recheck.due(step)
        losses, batches, tokens, data_time = [], [], 0, 0.0
        for _ in range(grad_accum):
            t0 = time.perf_counter()
            inputs, labels = next(self.data.train_loader)
            data_time += time.perf_counter() - t0
            tokens += self.model.objective.units(inputs)
            losses.append(self.forward_backward(inputs, labels))
            batches += [(inputs, labels)] if recheck else []  # kept on a recheck step only
        if recheck:
            params = [p for m in self.model.parts for p in m.parameters()]
            self.health.recheck_step(step, params, lambda: [self.forward_backward(*b) for b in batches])
        return losses, tokens, data_time

    # --- one optimizer step -----------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        """One optimizer step; the metrics say ``committed: False`` when it was not kept, and
        ``applied: False`` when the health checks skipped it (else torchft dropped it)."""
        ft = self.fault_tolerance
        ft.begin_step()
        self.health.begin_step(self.state.step + 1)
        self.optimizer.zero_grad(set_to_none=True)
        plan = self.begin_plan()
        losses, tokens, data_time = self.accumulate(plan.grad_accum)
        params = [p for m in self.model.parts for p in m.parameters()]
        local_loss = torch.stack(losses).mean()
        ft.reduce_gradients(params)  # the other replica groups' gradients (and losses, for the log)
        local_loss = ft.mean(local_loss)
        grad_norm = clip_grad_norm_(params, self.schedule.max_norm, pp_group=self.dims.pp_group())
        loss = self.dims.global_mean(local_loss)
        # decided from reduced values, so every rank applies or skips the step alike
        apply = self.health.judge(loss, float(grad_norm.item()))
        lr = self.optimizer.param_groups[0]["lr"]
        # named groups (optimizer.param_groups) with their own LR (Muon's peak differs): lr/<name>
        first_peak = self.optimizer.param_groups[0].get("initial_lr")
        hook_metrics: dict[str, float] = {
            f"lr/{g['group_name']}": float(g["lr"]) for g in self.optimizer.param_groups
            if "group_name" in g and g.get("initial_lr") != first_peak}
        for hook in self.step_hooks if apply else ():
            hook_metrics.update(hook())
        committed = ft.commit() and apply
        if committed:
            self.optimizer.step()
            self.ema.update()
            self.lr_scheduler.step()
        if apply and not math.isfinite(loss):
            raise TrainingDiverged(
                f"loss is {loss} at step {self.state.step + 1}; lower optimizer.lr, keep "
                "training.max_norm > 0, or use training.mixed_precision=fp32"
            )
        # Per-device throughput: the tokens of this data-parallel replica are shared by its
        # tp*pp*cp devices (each computes that fraction of the FLOPs).
        if apply:  # a skipped step's batch counts as not seen (as if the data had skipped it)
            self.monitors.throughput.update(tokens / (self.dims.tp * self.dims.pp * self.dims.cp))
            self.state.seen += tokens * self.dims.data_degree
        return {
            "loss": loss,
            "grad_norm": float(grad_norm.item()),
            "lr": lr,
            "data_time": data_time,
            "committed": committed,
            "applied": apply,  # the health checks kept it (torchft may still have dropped it)
            **self.plan_metrics(plan),
            **hook_metrics,
            **ft.metrics(),
        }

    def plan_metrics(self, plan: Any) -> dict[str, float]:
        """Under a schedule: the step's global batch in samples (and its seq_len under a seq-len one)."""
        sched = self.schedule.plan
        if sched is None or not sched.scheduled:
            return {}
        return {"batch_size": float(plan.global_batch), **({"seq_len": float(plan.seq_len)} if sched.seq_stages else {})}

    # --- validation ------------------------------------------------------------------
    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Mean loss over the first ``val_steps`` held-out batches (same batches every time), and
        each data source's own (``val/<name>/loss``) when the data is a mixture."""
        for m in self.model.parts:
            m.eval()
        metrics = self.model.objective.val_metrics(self._val_loss(self.data.val_loader_factory()))
        for name, factory in self.data.source_val_factories.items():
            metrics[f"val/{name}/loss"] = self._val_loss(factory())
        for m in self.model.parts:
            m.train()
        return metrics

    def _val_loss(self, loader) -> float:
        total = torch.zeros((), device=self.device)
        count = 0
        for inputs, labels in loader:
            if count >= self.schedule.val_steps:
                break  # every rank reads the same number of batches, so all stop together
            total += self.model.runner.eval_loss(to_device(inputs, self.device), to_device(labels, self.device))
            count += 1
        return self.dims.global_mean(total / max(count, 1))

    # --- the loop --------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        for m in self.model.parts:
            m.train()
        self.monitors.throughput.reset()
        self.monitors.memory.reset_peak()
        while self.state.step < self.steps:
            metrics = self.train_step()
            self.goodput.add("data_wait", metrics["data_time"])
            committed, applied = metrics.pop("committed"), metrics.pop("applied")
            if not committed:
                # skipped by the health checks, or dropped by torchft (a group failed mid-step: lost
                # to that failure); the next batch retries the step
                self.goodput.unkept("lost" if applied else "health")
                continue
            self.state.step += 1
            self.state.losses.append(metrics["loss"])
            step = self.state.step
            self.health.end_step(step)
            self.goodput.add("straggler_wait", self.health.take_straggler_wait())
            if step % self.schedule.log_freq == 0 or step == self.steps or step == 1:
                metrics.update(self.monitors.throughput.report())
                mem = self.monitors.memory.report()
                metrics["memory"] = mem.get("memory_peak_gib", 0.0)
                metrics.update(mem)
                metrics.update(self.goodput.metrics())
                if step == 1:  # optimizer state exists from the first step on
                    metrics.update(state_memory_gib(self.model.parts, self.optimizer))
                self.monitors.metric_logger.log(metrics, step)
                self.monitors.memory.reset_peak()
            if self.schedule.val_freq > 0 and (step % self.schedule.val_freq == 0 or step == self.steps):
                with self.goodput.span("eval"):
                    val = self.validate()
                    val.update(self.ema.validate(self.validate))  # val/ema/loss; {} without an EMA
                self.last_val_loss = val["val/loss"]
                self.monitors.metric_logger.log(val, step)
                self.monitors.throughput.reset()  # validation time is not training throughput
            if self.periodic_eval.due(step, step == self.steps):
                with self.goodput.span("eval"):
                    scores, pictures = self.periodic_eval.run(step, step == self.steps)
                if scores:
                    self.monitors.metric_logger.log(scores, step)
                for key, (images, captions) in pictures.items():
                    self.monitors.metric_logger.log_images(key, images, step, captions)
                self.monitors.throughput.reset()
            with self.goodput.span("checkpoint"):  # an async save: its blocking part
                self.checkpointer.maybe_save(step, last=step == self.steps)
            self.monitors.profiler.step()
            self.goodput.step(step)
            if step < self.steps and self.preemption.should_stop():
                self.preemption.save_and_requeue(self.checkpointer, step)  # all ranks; ends this attempt
        return {
            "steps": self.state.step,
            "losses": list(self.state.losses),
            "final_loss": self.state.losses[-1] if self.state.losses else None,
            "final_val_loss": self.last_val_loss,
            f"{self.model.objective.unit}s_seen": self.state.seen,
        }
