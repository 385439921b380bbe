"""The per-rank pretraining program: build everything from the config, then train.

Runs identically in a single process, in each worker spawned by the local launcher, under
torchrun, and in each SLURM task. Order: distributed init -> mesh -> data -> model on meta ->
layout -> materialize + init -> optimizer / LR schedule -> (restore) -> train -> close.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import time
import warnings
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from titan_hydra.checkpoint.live import live_state_fns
from titan_hydra.config import to_container
from titan_hydra.data.loader import joined_batches
from titan_hydra.errors import ConfigError, UserError
from titan_hydra.errors import instantiate_checked as instantiate
from titan_hydra.kernels.attention_policy import apply_attention_kernel
from titan_hydra.kernels.attention_precision import apply_attention_precision
from titan_hydra.kernels.gated_delta_policy import apply_gated_delta_kernel, delta_layers
from titan_hydra.logger.metric_logger import MetricLogger
from titan_hydra.metrics.memory import MemoryMonitor
from titan_hydra.metrics.summary import run_footer, run_header
from titan_hydra.metrics.throughput import ThroughputMeter, cpu_bf16_slower_than_fp32, device_peak_tflops
from titan_hydra.models.parametrization import Geometry, rescale_init
from titan_hydra.models.registry import build_model
from titan_hydra.parallel.apply import parallelize
from titan_hydra.parallel.compile import compiled_graphs
from titan_hydra.parallel.full_state import gather_full_state
from titan_hydra.runtime.device import check_backend, check_device
from titan_hydra.runtime.preemption import requeue_on_hang, watch_for_preemption
from titan_hydra.runtime.rendezvous import init_process_group  # bounded, one-line failure
from titan_hydra.runtime.threads import threads_here
from titan_hydra.spec import RunSpec
from titan_hydra.train.built import BoundEval, BuiltModel, DataPlan, Monitors, Schedule
from titan_hydra.train.health.monitor import HealthMonitor
from titan_hydra.train.health.watchdog import enable_flight_recorder
from titan_hydra.train.moe_balance import moe_balance_hooks
from titan_hydra.train.mtp_metrics import mtp_loss_hooks
from titan_hydra.train.optimizers import build_optimizer, clean_name
from titan_hydra.train.trainer import Trainer, TrainState

log = logging.getLogger("titan_hydra")


def world_info() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from the torch.distributed environment variables."""
    return (
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("LOCAL_RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
    )


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    # Set both ways: the mode is process-wide, and a run in the same process after a deterministic
    # one (tests, Hydra's in-process multirun) must not inherit it (it also changes which kernels
    # compile and run: see compile.check_settings).
    torch.use_deterministic_algorithms(bool(deterministic))
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def setup_device(cluster: DictConfig, local_rank: int) -> torch.device:
    check_device(str(cluster.device))
    if cluster.device == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(cluster: DictConfig, world_size: int) -> None:
    if world_size > 1 and not dist.is_initialized():
        check_backend(str(cluster.device), str(cluster.backend))
        init_process_group(str(cluster.backend), float(cluster.init_timeout_s))




FULL_INIT_MAX_PARAMS = 1.5e9


def geometry_of(spec: RunSpec) -> dict[str, Geometry]:
    """The ``parametrization`` group's per-parameter geometry (muP roles and width multipliers;
    empty under sp): what the init and the optimizer's LR multipliers read."""
    node = OmegaConf.select(spec.config, "parametrization", default=None)
    return {} if node is None else instantiate(node, _convert_="all").geometry(spec.family, spec.model_args)


def rescaled(part: torch.nn.Module, geometry: dict[str, Geometry]) -> None:
    """``part``'s fresh init at its parametrization's std (nothing under sp)."""
    if geometry:
        rescale_init([(clean_name(n), p) for n, p in part.named_parameters()], geometry)


def init_weights(spec: RunSpec, parts: list[torch.nn.Module], device: torch.device, rank: int,
                 geometry: dict[str, Geometry] | None = None) -> None:
    """Materialize the meta-device parts and give them their initial weights (rescaled by the
    width parametrization's ``geometry``, per parameter FQN, on every layout).

    With ``init_mode=full`` (auto below 1.5B parameters) rank 0 builds the whole model on CPU
    from the seed and its full state dict is broadcast into every rank's shards, so every
    layout starts from the weights a single process would have. ``sharded`` lets each rank
    initialize its own shards: no full copy anywhere, but weights differ between layouts.
    """
    seed = spec.config.training.seed
    for part in parts:
        part.to_empty(device=device)
        torch.manual_seed(seed)
        with torch.no_grad(), warnings.catch_warnings():
            # DTensor warns once per rank that its random ops "may not have complete support on
            # cpu device mesh": on CPU each shard draws its own numbers, which is what the
            # README documents (init_mode=full then overwrites them with rank 0's full init).
            warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
            part.init_weights(buffer_device=device)
        rescaled(part, geometry or {})
    mode = spec.config.training.init_mode
    if mode == "auto":
        mode = "full" if spec.shape.params <= FULL_INIT_MAX_PARAMS else "sharded"
    if mode != "full" or (spec.world_size == 1 and len(parts) == 1 and device.type == "cpu"):
        return  # one CPU process already initialized the full model from the seed
    # Otherwise the full init is drawn on CPU, whatever the device: the same seed gives the same
    # weights on CPU and GPU (the accelerator's generator draws other numbers), so a GPU run can be
    # checked step by step against a CPU one. Only rank 0 holds the full model.
    full_sd: dict[str, torch.Tensor] = {}
    if rank == 0:
        with torch.device("cpu"):
            _, full = build_model(spec.config.model)
            torch.manual_seed(seed)  # after construction: same RNG stream as the meta path above
            full.init_weights()
            rescaled(full, geometry or {})
        full_sd = full.state_dict()
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=spec.world_size > 1, strict=False)
    for part in parts:
        set_model_state_dict(part, dict(full_sd), options=options)  # a copy: DSD rewrites the dict it gets
    torch.manual_seed(seed)


def logger_backends(spec: RunSpec, run_dir: str) -> dict[str, Any]:
    """Logger configs with the run's W&B identity: the name from ``logger.wandb.name``, else
    ``run_name`` (a sweep job's overrides), else the run dir; ``tags`` added to the backend's."""
    cfg = spec.config
    backends = OmegaConf.to_container(cfg.logger, resolve=True, enum_to_str=True)
    wandb = backends.get("wandb")
    if wandb is not None:
        wandb["name"] = wandb.get("name") or cfg.run_name or os.path.basename(os.path.normpath(run_dir))
        own = list(wandb.get("tags") or [])
        wandb["tags"] = own + [t for t in cfg.tags if t not in own]
    return backends


def build_dataset(data: DictConfig):
    """The `data` group's dataset."""
    return instantiate(data, _convert_="all")


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
    cluster = spec.config.cluster
    torch.set_num_threads(threads_here(cluster.threads_per_proc).n)  # this rank's share of the host's cores
    device = setup_device(cluster, local_rank)
    if spec.config.health.enable and spec.config.health.hang_timeout_s > 0:
        enable_flight_recorder()  # a hang report then holds the last collectives (set before the group starts)
    init_distributed(cluster, world_size)
    try:
        summary = _run(spec, run_dir, rank, device, return_state)
    except BaseException:
        if dist.is_initialized():
            dist.destroy_process_group()  # no barrier: a failed rank's peers may never get there
        raise
    if dist.is_initialized():
        # Every rank is past its last collective before any closes its gloo connections: a peer
        # torn down mid-exchange made a rank abort at exit ("terminate called without an active
        # exception") about one torchrun run in five.
        dist.barrier()
        dist.destroy_process_group()
    return summary


def build_data(spec: RunSpec) -> DataPlan:
    """Dataset and this rank's loaders. Runs before the model: bad records fail before anything big."""
    training, dims = spec.config.training, spec.dims
    dataset = build_dataset(spec.config.data)
    dp_rank, dp_degree = dims.data_rank(), dims.data_degree
    train_loader = dataset.loader("train", spec.batch.local, dp_rank=dp_rank, dp_degree=dp_degree)
    val_bs = training.val_local_batch_size or spec.batch.local
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
    if training.val_freq:
        val_loader_factory()  # a validation split too small for one batch fails now, not at step val_freq
        for factory in sources.values():
            factory()
    return DataPlan(dataset, train_loader, val_loader_factory, sources)


def build_parallel_model(spec: RunSpec, device: torch.device, rank: int, dataset: Any) -> BuiltModel:
    """Model on meta -> attention precision -> float8 -> layout -> materialized and initialized."""
    cfg, dims, family, mp = spec.config, spec.dims, spec.family, spec.mixed_precision
    with torch.device("meta"):
        _, model = build_model(cfg.model)
    seq_len = spec.batch.seq_len
    attention_dtype = apply_attention_precision(model, str(cfg.training.attention_precision), mp, device, seq_len)
    sdpa_dtype = attention_dtype or (torch.bfloat16 if mp == "bf16" else torch.float32)
    attention_kernel = apply_attention_kernel(model, str(cfg.training.attention_kernel), device, dims.cp,
                                              seq_len=seq_len // dims.cp, dtype=sdpa_dtype)
    if attention_kernel.name == "small_head":
        attention_dtype = torch.float32  # the kernel computes in fp32 whatever q/k/v arrive in
    delta_kernel = (apply_gated_delta_kernel(model, str(cfg.training.gated_delta_kernel), device)
                    if delta_layers(model) else None)
    float8 = instantiate(cfg.float8, _convert_="all")
    model = float8.convert(model)
    loss_fn = family.training_loss(spec.model_args)
    pm = parallelize(
        model, family, dims, device=device, mixed_precision=mp, loss_fn=loss_fn,
        grad_accum_steps=spec.batch.grad_accum, ac=instantiate(cfg.activation_checkpoint),
        compiler=instantiate(cfg.compile), document_eos_id=getattr(dataset, "document_eos_id", None),
    )
    family.set_loss_scale(pm.model_parts, pm.runner.loss_scale)  # model-internal losses weigh like the main one
    geometry = geometry_of(spec)
    init_weights(spec, pm.model_parts, device, rank, geometry)
    return BuiltModel(family, spec.model_args, pm.model_parts, pm.runner, float8,
                      family.flops_per_unit(spec.model_args, dataset), attention_dtype, attention_kernel,
                      loss_hooks=mtp_loss_hooks(loss_fn, dims, pm.runner.loss_scale, device),
                      delta_kernel=delta_kernel, geometry=geometry)


def optimizer_and_schedule(spec: RunSpec, built: BuiltModel):
    """Optimizer over this rank's parameters (``_partial_``) and its LR schedule."""
    named = [(name, p) for part in built.parts for name, p in part.named_parameters()]
    optimizer = build_optimizer(spec.config.optimizer, named, built.geometry)
    built.float8.register(optimizer, built.parts)  # float8 scale precompute after each optimizer step
    return optimizer, instantiate(spec.config.lr_scheduler)(optimizer, spec.config.training.steps)


def periodic_eval_of(spec: RunSpec, built: BuiltModel, data: DataPlan) -> BoundEval | None:
    """The ``eval`` group's evaluator bound to this rank's model, or None when it has nothing to do
    (``eval.freq``, ``eval.sample_every`` and ``eval.fidelity_every`` all 0)."""
    evaluator = instantiate(spec.config.eval)
    evaluator.check_data(data.dataset)
    return BoundEval(evaluator, built, data.dataset) if evaluator.enabled else None


def build_throughput(spec: RunSpec, device: torch.device, rank: int, built: BuiltModel) -> ThroughputMeter:
    bf16 = spec.mixed_precision == "bf16"
    peak = device_peak_tflops(
        device, torch.bfloat16 if bf16 else torch.float32, override=spec.config.cluster.peak_tflops,
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
    if str(spec.config.compile.mode) == "none":
        return []
    return [lambda: {"compile/graphs": float(compiled_graphs())}]


def header_of(spec: RunSpec, data: DataPlan, built: BuiltModel, run_dir: str,
              fault_tolerance: str | None = None, health: HealthMonitor | None = None) -> str:
    cfg = spec.config
    return run_header(
        flavor=spec.flavor, family=built.family.name, shape=spec.shape, dims=spec.dims, world_size=spec.world_size,
        precision=spec.precision, attention_dtype=built.attention_dtype, attention_kernel=built.attention_kernel,
        delta_kernel=built.delta_kernel, ac=str(cfg.activation_checkpoint.mode), compile=str(cfg.compile.mode), float8=str(cfg.float8.recipe),
        data_name=str(cfg.data.name)
        + (" (document mask)" if getattr(data.dataset, "document_eos_id", None) is not None else ""),
        data_stats=getattr(data.dataset, "stats", {}),
        seq_len=spec.batch.seq_len, local_batch=spec.batch.local, global_batch=spec.batch.global_,
        grad_accum=spec.batch.grad_accum, steps=int(cfg.training.steps), run_dir=run_dir,
        data_summary=data.dataset.summary() if hasattr(data.dataset, "summary") else None,
        fault_tolerance=fault_tolerance,
        health=health.settings.describe() if health is not None else "off (a non-finite loss stops the run)",
        fault_injection=health.injector.faults.describe() if health is not None and health.injector.faults.enabled
        else None,
        threads=(torch.get_num_threads(), threads_here(cfg.cluster.threads_per_proc).reason),
    )


def health_of(spec: RunSpec, run_dir: str, rank: int, device: torch.device, built: BuiltModel, data: DataPlan,
              checkpointer, state: TrainState, metric_logger: MetricLogger) -> HealthMonitor | None:
    """The ``health`` group's checks for this rank (None when off and no fault is injected)."""
    settings, faults = instantiate(spec.config.health), instantiate(spec.config.fault_injection)
    if not settings.enable and not faults.enabled:
        return None
    if settings.enable and settings.recheck_every and device.type == "cuda" and not spec.config.training.deterministic:
        raise ConfigError(f"health.recheck_every={settings.recheck_every} compares gradients bit for bit, which needs "
                          "deterministic kernels on GPU: set training.deterministic=true or health.recheck_every=0")
    return HealthMonitor(settings, faults, run_dir=run_dir, rank=rank, world_size=spec.world_size, device=device,
                         parts=built.parts, checkpointer=checkpointer, loader=data.train_loader, state=state,
                         metric_logger=metric_logger, dims=spec.dims,
                         restart=requeue_on_hang())  # None outside SLURM: the launcher restarts


def schedule_of(spec: RunSpec) -> Schedule:
    t = spec.config.training
    return Schedule(steps=int(t.steps), grad_accum_steps=spec.batch.grad_accum, max_norm=float(t.max_norm),
                    log_freq=int(t.log_freq), val_freq=int(t.val_freq), val_steps=int(t.val_steps))


def _run(spec: RunSpec, run_dir: str, rank: int, device: torch.device, return_state: bool = False) -> dict[str, Any]:
    started = time.perf_counter()
    cfg = spec.config
    seed_everything(cfg.training.seed, cfg.training.deterministic)
    spec.dims.build_mesh(device.type)
    ft = instantiate(cfg.fault_tolerance)
    data = build_data(spec)
    built = build_parallel_model(spec, device, rank, data.dataset)
    optimizer, lr_scheduler = optimizer_and_schedule(spec, built)
    # the config as composed, plus what its ``auto`` choices settled on here (W&B compares runs by it)
    resolved = {"mixed_precision": spec.mixed_precision, "attention_kernel": built.attention_kernel.name}
    metric_logger = MetricLogger(run_dir, rank, backends=logger_backends(spec, run_dir),
                                 config={**to_container(cfg), "resolved": resolved})
    profiler = instantiate(cfg.profiling)(run_dir=run_dir, rank=rank, model_parts=built.parts,
                                          optimizer=optimizer, device=device)
    state = TrainState()
    checkpointer = instantiate(cfg.checkpoint)(
        run_dir=run_dir, model_parts=built.parts, optimizer=optimizer, lr_scheduler=lr_scheduler,
        train_loader=data.train_loader, train_state=state, dims=spec.dims, family=built.family,
        model_args=built.args, flavor=spec.flavor, rank=rank, world_size=spec.world_size,
    )
    health = health_of(spec, run_dir, rank, device, built, data, checkpointer, state, metric_logger)
    trainer = Trainer(
        model=built, optimizer=optimizer, lr_scheduler=lr_scheduler, data=data, dims=spec.dims,
        schedule=schedule_of(spec), state=state, device=device, checkpointer=checkpointer,
        monitors=Monitors(metric_logger, build_throughput(spec, device, rank, built), MemoryMonitor(device), profiler),
        preemption=watch_for_preemption(rank, spec.world_size, device),  # None outside SLURM
        step_hooks=moe_balance_hooks(built.parts, spec.dims) + built.family.step_hooks(built.parts, spec.dims)
        + built.loss_hooks + compile_hooks(spec),
        periodic_eval=periodic_eval_of(spec, built, data), fault_tolerance=ft if ft.enabled else None,
        health=health,
    )
    if rank == 0:
        print(header_of(spec, data, built, run_dir, ft.describe() if ft.enabled else None, health), flush=True)
    try:
        summary = _train(trainer, checkpointer, ft, rank, device, built, optimizer)
    finally:
        ft.close()
        outputs = metric_logger.outputs()
        metric_logger.close()
        if profiler is not None:
            profiler.close()
    if rank == 0:
        print(run_footer(summary, seconds=time.perf_counter() - started, run_dir=run_dir, outputs=outputs), flush=True)
    summary["run_dir"] = run_dir
    if return_state:
        summary["full_state"] = gather_full_state(built.parts)
    summary["dataset_stats"] = getattr(data.dataset, "stats", {})
    return summary


def _train(trainer: Trainer, checkpointer, ft, rank: int, device: torch.device, built: BuiltModel,
           optimizer) -> dict[str, Any]:
    """Restore, join the torchft quorum (after the restore: it compares the groups' steps), train."""
    checkpointer.restore()
    if checkpointer.seed_only:
        trainer.steps = 0
    if ft.enabled:
        ft.start(*live_state_fns(checkpointer.run), rank=rank, world_size=trainer.dims.world_size,
                 step=trainer.state.step, device=device, model_parts=built.parts, optimizer=optimizer)
    if trainer.health is not None:
        trainer.health.start()  # the watchdog counts from the restored step
    try:
        summary = trainer.train()
    finally:
        if trainer.health is not None:
            trainer.health.close()
    if trainer.health is not None:
        summary["health"] = trainer.health.summary()
    checkpointer.close()
    return summary
