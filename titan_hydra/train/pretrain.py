"""The per-rank pretraining program: build everything from the spec, then train.

Runs identically in a single process, in each worker spawned by the local launcher, under
torchrun, and in each SLURM task. Order: distributed init -> mesh -> data -> model on meta ->
layout -> materialize + init -> optimizer / LR schedule -> services -> (restore) -> train -> close.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from titan_hydra.checkpoint.live import live_state_fns
from titan_hydra.errors import UserError
from titan_hydra.metrics.summary import run_footer
from titan_hydra.parallel.full_state import gather_full_state
from titan_hydra.runtime.threads import threads_here
from titan_hydra.spec import RunSpec
from titan_hydra.train.built import Placement, Schedule
from titan_hydra.train.health.watchdog import enable_flight_recorder
from titan_hydra.train.model_build import build_parallel_model, optimization_of
from titan_hydra.train.process import (
    abandon_distributed, close_distributed, init_distributed, seed_everything, setup_device, world_info,
)
from titan_hydra.train.services import build_data, build_services, header_of
from titan_hydra.train.trainer import Trainer, TrainState


def run(spec: RunSpec, run_dir: str, return_state: bool = False) -> dict[str, Any]:
    """Train one rank of the run ``spec`` describes. Returns the run summary (losses, final
    validation loss...).

    ``return_state=True`` adds ``full_state``: this rank's trained parameters gathered to
    full CPU tensors (tests compare them across layouts).
    """
    if not isinstance(spec, RunSpec):
        raise TypeError(f"run() takes the RunSpec that titan_hydra.validate.validate(cfg) returns, not {type(spec).__name__}")
    rank, local_rank, world_size = world_info()
    if world_size != spec.world_size:
        raise UserError(f"this process is one of {world_size} ranks (WORLD_SIZE) but the run was planned for "
                        f"{spec.world_size}; launch it with cluster.nproc_per_node x cluster.nnodes = {world_size}")
    torch.set_num_threads(threads_here(spec.cluster.threads_per_proc).n)  # this rank's share of the host's cores
    device = setup_device(spec.cluster, local_rank)
    if spec.health.enable and spec.health.hang_timeout_s > 0:
        enable_flight_recorder()  # a hang report then holds the last collectives (set before the group starts)
    init_distributed(spec.cluster, world_size)
    try:
        summary = _run(spec, run_dir, Placement(rank, device, spec.dims), return_state)
    except BaseException:
        abandon_distributed()
        raise
    close_distributed()
    return summary


def schedule_of(spec: RunSpec) -> Schedule:
    t = spec.training
    return Schedule(steps=int(t.steps), grad_accum_steps=spec.batch.grad_accum, max_norm=float(t.max_norm),
                    log_freq=int(t.log_freq), val_freq=int(t.val_freq), val_steps=int(t.val_steps),
                    plan=spec.batch.schedule)


def _run(spec: RunSpec, run_dir: str, where: Placement, return_state: bool = False) -> dict[str, Any]:
    started = time.perf_counter()
    seed_everything(spec.training.seed, spec.training.deterministic)
    spec.dims.build_mesh(where.device.type)
    data = build_data(spec)
    built = build_parallel_model(spec, where.device, where.rank, data.dataset)
    optim = optimization_of(spec, built)
    state = TrainState()
    services = build_services(spec, run_dir, where, built, data, optim, state)
    trainer = Trainer(model=built, optim=optim, data=data, schedule=schedule_of(spec), services=services,
                      state=state, where=where)
    if where.rank == 0:
        print(header_of(spec, data, built, run_dir, services), flush=True)
    monitors = services.monitors
    try:
        summary = _train(trainer)
    finally:
        spec.fault_tolerance.close()
        outputs = monitors.metric_logger.outputs()
        monitors.metric_logger.close()
        monitors.profiler.close()
    services.goodput.close()  # only a run that ended well: a failed attempt's successor counts a restart
    goodput = services.goodput.summary()
    if goodput is not None:
        summary["goodput"] = goodput
    if where.rank == 0:
        print(run_footer(summary, seconds=time.perf_counter() - started, run_dir=run_dir, outputs=outputs), flush=True)
    summary["run_dir"] = run_dir
    if return_state:
        summary["full_state"] = gather_full_state(built.parts)
    summary["dataset_stats"] = getattr(data.dataset, "stats", {})
    return summary


def _train(trainer: Trainer) -> dict[str, Any]:
    """Restore, join the torchft quorum (after the restore: it compares the groups' steps), train."""
    checkpointer, health = trainer.checkpointer, trainer.health
    checkpointer.restore()
    trainer.ema.start(trainer.state.step)  # from the restored EMA, else from the weights the run starts with
    if checkpointer.seed_only:
        trainer.steps = 0
    trainer.fault_tolerance.start(*live_state_fns(checkpointer.run), rank=trainer.rank, world_size=trainer.dims.world_size,
                                  step=trainer.state.step, device=trainer.device, model_parts=trainer.model.parts,
                                  optimizer=trainer.optimizer)
    health.start()  # the watchdog counts from the restored step
    trainer.goodput.begin(trainer.state.step)  # start-up (and restore) end here; the ledger continues
    try:
        summary = trainer.train()
    finally:
        health.close()
    report = health.summary()  # None: the checks were off
    if report is not None:
        summary["health"] = report
    checkpointer.close()
    return summary
