"""What runs around this rank's loop: data, metric sinks, throughput and memory monitors, the
profiler, the checkpointer, periodic evaluation, health checks, preemption, fault tolerance;
and the run header. Each built from the spec's settings or partials; an optional service that
is off is a null object (``train/nulls.py``). The goodput ledger is always on (rank 0 writes it)."""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Callable

import torch

from titan_hydra.data.loader import joined_batches
from titan_hydra.data.staged import StagedLoader
from titan_hydra.errors import ConfigError
from titan_hydra.errors import instantiate_checked as instantiate
from titan_hydra.logger.metric_logger import MetricLogger
from titan_hydra.metrics.goodput_ledger import GoodputLedger
from titan_hydra.metrics.memory import MemoryMonitor
from titan_hydra.metrics.summary import run_header
from titan_hydra.metrics.throughput import ThroughputMeter, cpu_bf16_slower_than_fp32, device_peak_tflops
from titan_hydra.data.settings import DataSettings
from titan_hydra.models.protocol import RunsStepHooks
from titan_hydra.parallel.compile import compiled_graphs
from titan_hydra.runtime.preemption import requeue_on_hang, watch_for_preemption
from titan_hydra.runtime.threads import threads_here
from titan_hydra.spec import RunSpec
from titan_hydra.train.built import BoundEval, BuiltModel, DataPlan, Monitors, Optimization, Placement, Services
from titan_hydra.train.ema import weight_ema_of
from titan_hydra.train.eval import PeriodicEval
from titan_hydra.train.health.monitor import HealthMonitor
from titan_hydra.train.moe_balance import moe_balance_hooks
from titan_hydra.train.nulls import NoEval, NoFaultTolerance, NoHealth, NoPreemption, NoProfiler

log = logging.getLogger("titan_hydra")


def build_dataset(data: DataSettings):
    """The ``data`` group's dataset (its label ``name`` is not a constructor argument)."""
    return instantiate(dict(data.dataset_node), _convert_="all")


def train_loader_of(spec: RunSpec, dataset: Any, dp_rank: int, dp_degree: int) -> tuple[Any, dict]:
    """This rank's training loader, and DataPlan's ``stage`` under a seq-len schedule: a loader
    per stage's window length (data/staged.py) that the trainer selects before each step."""
    make = functools.partial(dataset.loader, "train", spec.batch.local, dp_rank=dp_rank, dp_degree=dp_degree)
    stages = spec.batch.schedule.seq_stages
    if not stages:
        return make(), {}
    loader = StagedLoader(lambda seq_len: make(seq_len=seq_len), [v for _, v in stages])
    return loader, {"stage": loader.select}


def build_data(spec: RunSpec) -> DataPlan:
    """Dataset and this rank's loaders. Runs before the model: bad records fail before anything big."""
    dims = spec.dims
    dataset = build_dataset(spec.data)
    dp_rank, dp_degree = dims.data_rank(), dims.data_degree
    train_loader, stage = train_loader_of(spec, dataset, dp_rank, dp_degree)
    val_bs = spec.training.val_local_batch_size or spec.batch.local
    # torchft replica groups validate on the slices of every group (the same data a DDP run of all
    # their ranks validates on), so a group's val/loss is the run's and groups compare across layouts
    val_ranks = [g * dims.dp_degree + dims.dp_rank() for g in range(dims.replica_groups)]

    def val_loader(make: Callable[..., Any]) -> Callable[[], Any]:
        def factory():
            loaders = [make(val_bs, dp_rank=r, dp_degree=dp_degree, infinite=False) for r in val_ranks]
            return loaders[0] if len(loaders) == 1 else joined_batches(loaders)
        return factory

    val_loader_factory = val_loader(functools.partial(dataset.loader, "val"))
    sources = {name: val_loader(functools.partial(dataset.source_loader, name, "val"))
               for name in (dataset.val_sources() if hasattr(dataset, "val_sources") else [])}
    if spec.training.val_freq:
        val_loader_factory()  # a validation split too small for one batch fails now, not at step val_freq
        for factory in sources.values():
            factory()
    return DataPlan(dataset, train_loader, val_loader_factory, sources, **stage)


def logger_backends(spec: RunSpec, run_dir: str) -> dict[str, Any]:
    """Logger nodes with the run's W&B identity: the name from ``logger.wandb.name``, else
    ``run_name`` (a sweep job's overrides), else the run dir; ``tags`` added to the backend's."""
    backends = {k: dict(v) if v is not None else None for k, v in spec.logger.backends.items()}
    wandb = backends.get("wandb")
    if wandb is not None:
        wandb["name"] = wandb.get("name") or spec.logger.run_name or os.path.basename(os.path.normpath(run_dir))
        own = list(wandb.get("tags") or [])
        wandb["tags"] = own + [t for t in spec.logger.tags if t not in own]
    return backends


def metric_logger_of(spec: RunSpec, run_dir: str, rank: int, built: BuiltModel) -> MetricLogger:
    # the config as composed, plus what its ``auto`` choices settled on here (W&B compares runs by it)
    resolved = {"mixed_precision": spec.mixed_precision, "attention_kernel": built.attention_kernel.name}
    return MetricLogger(run_dir, rank, backends=logger_backends(spec, run_dir),
                        config={**spec.resolved, "resolved": resolved})


def build_throughput(spec: RunSpec, device: torch.device, rank: int, built: BuiltModel) -> ThroughputMeter:
    bf16 = spec.mixed_precision == "bf16"
    peak = device_peak_tflops(
        device, torch.bfloat16 if bf16 else torch.float32, override=spec.cluster.peak_tflops,
        # The first few runs on a machine re-measure (~1-3 s on CPU) and the cache keeps the best
        # value, so one measurement taken under load cannot leave MFU inflated for every later run.
        refine=True,
    )
    if device.type == "cpu" and bf16 and rank == 0:
        slow = cpu_bf16_slower_than_fp32()
        if slow:
            log.warning("this CPU has no native bf16 matmuls (bf16 %.3f vs fp32 %.3f TFLOP/s measured): "
                        "bf16 training will be slow here; use training.mixed_precision=fp32", *slow)
    return ThroughputMeter(built.flops_per_unit, peak, world_size=spec.world_size, rate_key=built.objective.rate_key)


def compile_hooks(spec: RunSpec) -> list:
    """A compiled run logs ``compile/graphs`` (dynamo graphs so far): flat after the first steps
    means no step recompiles."""
    return [lambda: {"compile/graphs": float(compiled_graphs())}] if spec.compiler.enabled else []


def health_of(spec: RunSpec, run_dir: str, rank: int, device: torch.device, built: BuiltModel, data: DataPlan,
              checkpointer, state, metric_logger: MetricLogger) -> HealthMonitor | NoHealth:
    """The ``health`` group's checks for this rank (NoHealth when off and no fault is injected)."""
    settings, faults = spec.health, spec.fault_injection
    if not settings.enable and not faults.enabled:
        return NoHealth()
    if settings.enable and settings.recheck_every and device.type == "cuda" and not spec.training.deterministic:
        raise ConfigError(f"health.recheck_every={settings.recheck_every} compares gradients bit for bit, which needs "
                          "deterministic kernels on GPU: set training.deterministic=true or health.recheck_every=0")
    return HealthMonitor(settings, faults, run_dir=run_dir, rank=rank, world_size=spec.world_size, device=device,
                         parts=built.parts, checkpointer=checkpointer, loader=data.train_loader, state=state,
                         metric_logger=metric_logger, dims=spec.dims,
                         restart=requeue_on_hang())  # None outside SLURM: the launcher restarts


def build_services(spec: RunSpec, run_dir: str, where: Placement, built: BuiltModel, data: DataPlan,
                   optim: Optimization, state) -> Services:
    """Every service of this rank, in the order they depend on each other."""
    rank, device = where.rank, where.device
    metric_logger = metric_logger_of(spec, run_dir, rank, built)
    profiler = spec.profiler(run_dir=run_dir, rank=rank, model_parts=built.parts, optimizer=optim.optimizer,
                             device=device)
    ema = weight_ema_of(built.parts, spec.training.ema_decay, rank)
    checkpointer = spec.checkpoint(
        run_dir=run_dir, model_parts=built.parts, optimizer=optim.optimizer, lr_scheduler=optim.lr_scheduler,
        train_loader=data.train_loader, train_state=state, dims=spec.dims, family=built.family,
        model_args=built.args, flavor=spec.flavor, rank=rank, world_size=spec.world_size,
        ema=ema if ema.enabled else None,
    )
    spec.eval.check_data(data.dataset)
    return Services(
        monitors=Monitors(metric_logger, build_throughput(spec, device, rank, built), MemoryMonitor(device),
                          NoProfiler() if profiler is None else profiler),
        checkpointer=checkpointer,
        periodic_eval=BoundEval(PeriodicEval(spec.eval), built, data.dataset, spec.dims) if spec.eval.enabled else NoEval(),
        fault_tolerance=spec.fault_tolerance if spec.fault_tolerance.enabled else NoFaultTolerance(),
        health=health_of(spec, run_dir, rank, device, built, data, checkpointer, state, metric_logger),
        preemption=preempted_by_slurm(rank, spec.world_size, device),
        step_hooks=tuple(moe_balance_hooks(built.parts, spec.dims) + family_step_hooks(built, spec.dims)
                         + built.loss_hooks + compile_hooks(spec)),
        ema=ema,
        goodput=GoodputLedger(run_dir, rank),
    )


def family_step_hooks(built: BuiltModel, dims: Any) -> list:
    """The family's own once-per-step work (the ``RunsStepHooks`` capability; none without it)."""
    return built.family.step_hooks(built.parts, dims) if isinstance(built.family, RunsStepHooks) else []


def preempted_by_slurm(rank: int, world_size: int, device: torch.device):
    """The SLURM job's preemption watcher, or NoPreemption outside one."""
    watcher = watch_for_preemption(rank, world_size, device)
    return NoPreemption() if watcher is None else watcher


def header_of(spec: RunSpec, data: DataPlan, built: BuiltModel, run_dir: str, services: Services) -> str:
    ft, health = services.fault_tolerance, services.health
    checked = isinstance(health, HealthMonitor)
    return run_header(
        flavor=spec.flavor, family=built.family.name, shape=spec.shape, dims=spec.dims, world_size=spec.world_size,
        precision=spec.precision, attention_dtype=built.attention_dtype, attention_kernel=built.attention_kernel,
        delta_kernel=built.delta_kernel, ac=spec.activation_checkpoint.mode, compile=spec.compiler.mode,
        float8=spec.float8.recipe,
        data_name=spec.data.name + (" (document mask)" if getattr(data.dataset, "document_eos_id", None) is not None
                                    else ""),
        data_stats=getattr(data.dataset, "stats", {}),
        seq_len=spec.batch.seq_len, local_batch=spec.batch.local, global_batch=spec.batch.global_,
        grad_accum=spec.batch.grad_accum, steps=int(spec.training.steps), run_dir=run_dir,
        data_summary=data.dataset.summary() if hasattr(data.dataset, "summary") else None,
        fault_tolerance=ft.describe() if ft.enabled else None,
        health=health.settings.describe() if checked else "off (a non-finite loss stops the run)",
        fault_injection=spec.fault_injection.describe() if spec.fault_injection.enabled else None,
        threads=(torch.get_num_threads(), threads_here(spec.cluster.threads_per_proc).reason),
        schedule=spec.batch.schedule.describe() if spec.batch.schedule.scheduled else None,
    )
