"""``RunSpec``: one run, described once, handed down from the launcher to every rank.

The route is compose (Hydra) -> resolve (a sweep job's identity, ``auto`` layouts: the only
changes made to the config) -> ``RunSpec`` -> validate -> build -> train. ``spec_of`` is the one
reader of the composed config: it parses the model node, types ``training`` / ``cluster`` /
``data`` / ``optimizer``, and builds every group's object (or its partial, where the rank adds
what only it has) exactly once, refusing a value a setting cannot hold as it types it. Everything
after it (validation, the planner, the launchers, the rank's program) reads spec fields, never the
config; the plain resolved config travels along only to be logged.

Pickling into spawned workers: the family travels by name (a module-level object, looked up
again on arrival); every other field pickles as it is. The built group objects are settings
holders that own no process state until a rank starts them (a FaultTolerance's manager, a
Float8Converter's converted layers), so each worker receives fresh copies and builds them
no second time.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Optional, Protocol

from omegaconf import DictConfig, OmegaConf

from titan_hydra.checkpoint.manager import CheckpointManager, CheckpointSettings
from titan_hydra.config import ClusterConfig, TrainingConfig, precision_choice_of, run_settings, to_container
from titan_hydra.config.eval import EvalSettings
from titan_hydra.config.fault_injection import FaultInjection
from titan_hydra.config.health import Health
from titan_hydra.config.optimizer import OptimizerSettings
from titan_hydra.config.targets import check_targets
from titan_hydra.data.settings import DataSettings
from titan_hydra.errors import ConfigError
from titan_hydra.errors import instantiate_checked as instantiate
from titan_hydra.float8 import Float8Converter
from titan_hydra.hardware import Resolved
from titan_hydra.models.parametrization import Parametrization, with_multipliers
from titan_hydra.models.protocol import ModelFamily, ModelShape
from titan_hydra.models.registry import args_of, get_family
from titan_hydra.parallel.activation_checkpoint import ActivationCheckpointing
from titan_hydra.parallel.compile import Compiler
from titan_hydra.parallel.parallelism import ParallelDims
from titan_hydra.profiling import Profiler
from titan_hydra.runtime.fault_tolerance import FaultTolerance
from titan_hydra.schedules import LRSchedule, StepSchedule, resolve_lr_rule, schedule_of


class ModelArgs(Protocol):
    """A family's args: a dataclass of its shape fields (``ModelFamily.args_cls``)."""

    __dataclass_fields__: ClassVar[dict[str, Any]]


@dataclass(frozen=True)
class BatchPlan:
    """Samples per step: per rank, across the data-parallel ranks, and the accumulation between.
    Under a batch or seq-len schedule these are the largest step's (what memory and the header
    are sized by); ``schedule.at(step)`` is each step's own plan."""

    local: int
    global_: int
    grad_accum: int
    seq_len: int
    schedule: StepSchedule | None = None


@dataclass(frozen=True)
class LoggerSettings:
    """The metric sinks' nodes (built per rank, with its run dir) and the run's W&B identity."""

    backends: Mapping[str, Optional[Mapping[str, Any]]]  # sink name -> its node, or None when off
    run_name: str | None
    tags: tuple[str, ...]


@dataclass(frozen=True)
class RunSpec:
    world_size: int
    dims: ParallelDims  # degrees and batch slicing; the rank builds its DeviceMesh on it
    family: ModelFamily
    family_ref: str  # model.family: a built-in name or the dotted path the family is looked up by
    model_args: ModelArgs  # with the parametrization's multipliers: every model of the run is built from them
    model_target: str  # the model node's ``_target_``: the class ``model_args`` build
    flavor: str  # the model option's published name, or "custom"
    precision: Resolved  # training.mixed_precision as the device runs it, with the reason
    batch: BatchPlan
    training: TrainingConfig
    cluster: ClusterConfig
    data: DataSettings
    logger: LoggerSettings
    fault_tolerance: FaultTolerance
    parametrization: Parametrization
    eval: EvalSettings  # run on the rank's model by train/eval.PeriodicEval
    health: Health
    fault_injection: FaultInjection
    float8: Float8Converter
    activation_checkpoint: ActivationCheckpointing
    compiler: Compiler
    optimizer: OptimizerSettings  # built over the rank's parameters (train/optimizers.py)
    lr_scheduler: LRSchedule  # (optimizer, total_steps, step factor) -> LambdaLR
    checkpoint: functools.partial[CheckpointManager]  # the group's settings; the rank adds its parts and state
    profiler: functools.partial[Optional[Profiler]]  # build_profiler with the group's settings; the rank adds its parts
    resolved: Mapping[str, Any]  # the plain resolved config: logged (W&B) and written to disk, never read for settings
    dry_run: bool = False  # dry_run=true or simulate: nothing trains
    simulate: bool = False  # dry_run=simulate: the run is simulated on fake tensors (titan_hydra/simulate)

    @property
    def checkpoint_settings(self) -> CheckpointSettings:
        """The ``checkpoint`` group's settings (what its partial will build the manager with)."""
        return CheckpointSettings(**self.checkpoint.keywords)

    @property
    def shape(self) -> ModelShape:
        """The family's size terms (layers, heads, experts, parameters) of the model args."""
        return self.family.shape(self.model_args)

    @property
    def mixed_precision(self) -> str:
        return self.precision.value

    @property
    def token_data(self) -> bool:
        return self.data.token_data

    @property
    def fault_tolerant(self) -> bool:
        """One of several torchft replica groups."""
        return self.fault_tolerance.enabled

    @property
    def model_node(self) -> dict:
        """The node ``registry.build_model`` builds this run's model from: ``model_target`` with
        ``model_args``' fields, multipliers included."""
        return {"_target_": self.model_target, "family": self.family_ref, "flavor": self.flavor,
                **self.family.args_fields(self.model_args)}

    def with_dims(self, dims: ParallelDims) -> RunSpec:
        """This run on another layout (``parallelism=auto``'s candidates): the batch plan follows."""
        return dataclasses.replace(self, dims=dims, batch=batch_plan_of(dims, self.training, self.batch.schedule.lr_rule))

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["family"] = self.family_ref  # by name: looked up again in the worker
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state["family"] = get_family(state["family"])
        for key, value in state.items():
            object.__setattr__(self, key, value)


def flavor_of(model: Any) -> str:
    """The model option's published name (``model.flavor``), or "custom" for a hand-made shape."""
    return str(model.get("flavor") or "custom")


def world_size_of(cluster: ClusterConfig) -> int:
    """World size: under torchrun/SLURM the environment says; otherwise the cluster settings."""
    if "WORLD_SIZE" in os.environ:
        value = os.environ["WORLD_SIZE"]
        if not value.strip().isdigit() or int(value) < 1:
            raise ConfigError(f"WORLD_SIZE={value!r} in the environment is not a positive integer; unset it "
                              "or let torchrun / SLURM set it")
        return int(value)
    return int(cluster.nnodes) * int(cluster.nproc_per_node)


def check_positive(key: str, value: Any, allow_zero: bool = False) -> None:
    """A value that must be > 0 (or >= 0), refused in one line before anything divides by it or
    trains on it; None (unset) passes."""
    if value is not None and (value < 0 or (value == 0 and not allow_zero)):
        raise ConfigError(f"{key}={value} must be {'>= 0' if allow_zero else '> 0'}")


def training_of(node: DictConfig) -> TrainingConfig:
    """The ``training`` node as its schema dataclass, with the value rules its fields keep."""
    t = TrainingConfig(**to_container(node))
    for key in ("steps", "local_batch_size", "seq_len", "log_freq", "val_steps", "val_local_batch_size"):
        check_positive(f"training.{key}", getattr(t, key))
    for key in ("max_norm", "val_freq"):
        check_positive(f"training.{key}", getattr(t, key), allow_zero=True)
    if t.global_batch_size != -1 and t.global_batch_size < 1:
        raise ConfigError(f"training.global_batch_size={t.global_batch_size} must be -1 (local batch x data parallel) "
                          "or > 0")
    if not 0.0 <= t.ema_decay < 1.0:
        raise ConfigError(f"training.ema_decay={t.ema_decay} must be within [0, 1): 0 keeps no EMA of the weights, "
                          "0.999 averages over about the last 1000 steps")
    return t


def check_model_node(node: DictConfig) -> None:
    """Sizes a family would divide by, and constants a model would silently train on NaNs with (a
    negative rope_theta), refused before the family parses the node (absent keys: not checked)."""
    for key in ("dim", "n_layers", "n_heads", "vocab_size", "rope_theta", "norm_eps"):
        check_positive(f"model.{key}", OmegaConf.select(node, key))


def cluster_of(node: DictConfig) -> ClusterConfig:
    """The ``cluster`` node as its schema dataclass; what nothing else checks (counts, timeouts,
    the start method's environment default, the planner's memory headroom) refused in one line.
    Every key is checked whatever the layout: ``init_timeout_s`` matters only once a rendezvous
    happens, but a one-process run that accepts -1 teaches the user it was fine."""
    try:
        str(node.start_method)  # its default reads TITAN_HYDRA_START_METHOD
    except Exception as e:  # omegaconf's ValidationError, raised on access
        raise ConfigError(f"TITAN_HYDRA_START_METHOD={os.environ.get('TITAN_HYDRA_START_METHOD')!r} is not a "
                          "start method; set it to spawn, fork or forkserver (or unset it)") from e
    cluster = ClusterConfig(**to_container(node))
    for key in ("nproc_per_node", "nnodes", "threads_per_proc", "init_timeout_s", "timeout_min"):
        check_positive(f"cluster.{key}", getattr(cluster, key))
    for key in ("max_restarts", "max_requeue", "signal_delay_s"):
        check_positive(f"cluster.{key}", getattr(cluster, key), allow_zero=True)
    h = float(cluster.memory_headroom)
    if not 0.0 <= h < 1.0:
        raise ConfigError(f"cluster.memory_headroom={h} must be within [0, 1): the fraction of device memory "
                          "the planner keeps free (0 = none)")
    return cluster


def dims_of(node: DictConfig, world_size: int, ft: FaultTolerance) -> ParallelDims:
    """The ``parallelism`` node's ParallelDims for ``world_size``; torchft replica groups split the batch."""
    dims = instantiate(node, world_size=world_size, _convert_="all")
    if ft.enabled:
        dims.replica_groups, dims.replica_group = ft.replica_groups, ft.group
    return dims


def batch_plan_of(dims: ParallelDims, t: TrainingConfig, lr_rule: str = "none") -> BatchPlan:
    """The batch plan (the largest step's under a schedule) and the per-step schedule; a schedule
    that cannot run on this layout refused in one line."""
    local = int(t.local_batch_size)
    global_batch, grad_accum = dims.batch_plan(local, int(t.global_batch_size))
    schedule = schedule_of(local, dims.data_degree, global_batch, int(t.seq_len), t.batch_schedule,
                           t.seq_len_schedule, lr_rule, int(t.global_batch_size))
    return BatchPlan(local, schedule.max_global_batch, schedule.max_grad_accum, int(t.seq_len), schedule)


def spec_of(cfg: DictConfig) -> RunSpec:
    """The RunSpec of a composed config: its structural errors (degrees that do not multiply to the
    world size, a model node its family rejects, a group's own value rules) as one-line
    ConfigErrors, with each typed setting's own value rules; the cross-field rules are
    ``validate``'s, which reads the spec."""
    check_targets(cfg)  # every _target_ builds what its group builds, before anything is built
    cluster = cluster_of(cfg.cluster)
    world_size = world_size_of(cluster)
    training = training_of(cfg.training)
    ft = instantiate(cfg.fault_tolerance)
    dims = dims_of(cfg.parallelism, world_size, ft)
    node = OmegaConf.select(cfg, "parametrization", default=None)  # a hand-made config may lack it: sp
    parametrization = Parametrization() if node is None else instantiate(node, _convert_="all")
    check_model_node(cfg.model)
    family, args = args_of(cfg.model)
    # muP's logit and attention scales, CompleteP's residual scale (sp: none) go into the args, not
    # the config: every model of the run (its evaluation, a checkpoint's marker, an export) agrees
    multipliers = parametrization.model_multipliers(family, args)
    resolved = run_settings(cfg)
    resolved["model"].update(multipliers)  # the logged model is the one the run builds
    optimizer = OptimizerSettings.of(resolved["optimizer"])
    return RunSpec(
        world_size=world_size, dims=dims, family=family, family_ref=str(cfg.model.family),
        model_args=with_multipliers(args, multipliers), model_target=str(cfg.model._target_), flavor=flavor_of(cfg.model),
        precision=precision_choice_of(cfg),
        batch=batch_plan_of(dims, training, resolve_lr_rule(str(training.batch_lr_scaling), optimizer.target)),
        training=training, cluster=cluster, data=DataSettings.of(resolved["data"]),
        logger=LoggerSettings(resolved["logger"], resolved.get("run_name"), tuple(resolved.get("tags") or ())),
        fault_tolerance=ft, parametrization=parametrization,
        eval=instantiate(cfg.eval), health=instantiate(cfg.health), fault_injection=instantiate(cfg.fault_injection),
        float8=instantiate(cfg.float8, _convert_="all"),
        activation_checkpoint=instantiate(cfg.activation_checkpoint), compiler=instantiate(cfg.compile),
        optimizer=optimizer,
        lr_scheduler=instantiate(cfg.lr_scheduler, _convert_="all"),
        checkpoint=instantiate(cfg.checkpoint, _convert_="all"),
        profiler=instantiate(cfg.profiling, _convert_="all"),
        resolved=resolved, dry_run=dry_run_of(cfg.dry_run) != "false", simulate=dry_run_of(cfg.dry_run) == "simulate",
    )


DRY_RUN_MODES = ("false", "true", "simulate")


def dry_run_of(value: Any) -> str:
    """``dry_run``: false (train), true (print the plan) or simulate (build and step the run on fake
    tensors); the booleans Hydra parses ``true`` / ``false`` into are accepted as they are."""
    mode = str(value).lower()
    if mode not in DRY_RUN_MODES:
        raise ConfigError(f"dry_run={value!r} is not one of {', '.join(DRY_RUN_MODES)}")
    return mode
