"""``RunSpec``: one run, described once, handed down from the launcher to every rank.

The route is compose (Hydra) -> resolve (``auto`` layouts, a sweep job's identity: the only
changes made to the config) -> ``validate`` -> ``RunSpec`` -> build -> train. What several
layers need to know about a run (the degrees, the model family and its args, the precision the
device settles on, the batch plan) is worked out here, once, instead of each layer re-deriving
it from the raw config: ``ParallelDims`` is constructed once per process, the model node is
parsed once. Each group's object is still built from its own node (``spec.config.<group>``).

The spec pickles into spawned workers: the family travels by name (a family is a module-level
object, looked up again on arrival) and the rest as plain data.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from titan_hydra.config import precision_choice_of
from titan_hydra.errors import ConfigError
from titan_hydra.errors import instantiate_checked as instantiate
from titan_hydra.hardware import Resolved
from titan_hydra.models.parametrization import with_multipliers
from titan_hydra.models.protocol import ModelFamily
from titan_hydra.models.registry import args_of, get_family
from titan_hydra.parallel.dims import ParallelDims


@dataclass(frozen=True)
class BatchPlan:
    """Samples per step: per rank, across the data-parallel ranks, and the accumulation between."""

    local: int
    global_: int
    grad_accum: int
    seq_len: int


@dataclass(frozen=True)
class RunSpec:
    config: DictConfig  # resolved and validated; groups build their objects from their own nodes
    world_size: int
    dims: ParallelDims  # degrees and batch slicing; the rank builds its DeviceMesh on it
    family: ModelFamily
    model_args: Any
    flavor: str  # the model option's published name, or "custom"
    precision: Resolved  # training.mixed_precision as the device runs it, with the reason
    batch: BatchPlan
    token_data: bool  # a tokenized corpus (False: the family's own samples, e.g. images)
    fault_tolerant: bool  # one of several torchft replica groups

    @property
    def shape(self) -> Any:
        """The family's size terms (layers, heads, experts, parameters) of the model args."""
        return self.family.shape(self.model_args)

    @property
    def mixed_precision(self) -> str:
        return self.precision.value

    @property
    def dry_run(self) -> bool:
        return bool(self.config.dry_run)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["family"] = state["config"].model.family  # by name: looked up again in the worker
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state["family"] = get_family(state["family"])
        for key, value in state.items():
            object.__setattr__(self, key, value)


def flavor_of(model: DictConfig) -> str:
    """The model option's published name (``model.flavor``), or "custom" for a hand-made shape."""
    return str(model.get("flavor") or "custom")


def world_size_of(cfg: DictConfig) -> int:
    """World size: under torchrun/SLURM the environment says; otherwise the cluster config."""
    if "WORLD_SIZE" in os.environ:
        value = os.environ["WORLD_SIZE"]
        if not value.strip().isdigit() or int(value) < 1:
            raise ConfigError(f"WORLD_SIZE={value!r} in the environment is not a positive integer; unset it "
                              "or let torchrun / SLURM set it")
        return int(value)
    return int(cfg.cluster.nnodes) * int(cfg.cluster.nproc_per_node)


def dims_of(cfg: DictConfig, world_size: int) -> ParallelDims:
    """The ``parallelism`` node's ParallelDims for ``world_size``; torchft replica groups split the batch."""
    dims = instantiate(cfg.parallelism, world_size=world_size, _convert_="all")
    ft = instantiate(cfg.fault_tolerance)
    if ft.enabled:
        dims.replica_groups, dims.replica_group = ft.replica_groups, ft.group
    return dims


def parametrized(cfg: DictConfig, family: ModelFamily, args: Any) -> tuple[ModelFamily, Any]:
    """(family, args) with the ``parametrization`` group's model multipliers (muP's logit and
    attention scales, CompleteP's residual scale), written into ``cfg.model`` as well: every
    model built from the node or from the args (the run, its evaluation, a checkpoint's marker,
    an export) computes the same function. sp sets nothing. Idempotent."""
    node = OmegaConf.select(cfg, "parametrization", default=None)
    if node is None:
        return family, args
    values = instantiate(node, _convert_="all").model_multipliers(family, args)
    for key, value in values.items():
        cfg.model[key] = value
    return family, with_multipliers(args, values)


def spec_of(cfg: DictConfig) -> RunSpec:
    """The RunSpec of a composed config: its structural errors (degrees that do not multiply to the
    world size, a model node its family rejects) as one-line ConfigErrors; the cross-field rules
    are ``validate``'s, which calls this."""
    world_size = world_size_of(cfg)
    dims = dims_of(cfg, world_size)
    family, args = parametrized(cfg, *args_of(cfg.model))
    t = cfg.training
    global_batch, grad_accum = dims.batch_plan(int(t.local_batch_size), int(t.global_batch_size))
    return RunSpec(
        config=cfg, world_size=world_size, dims=dims, family=family, model_args=args,
        flavor=flavor_of(cfg.model),
        precision=precision_choice_of(cfg),
        batch=BatchPlan(int(t.local_batch_size), global_batch, grad_accum, int(t.seq_len)),
        token_data=OmegaConf.select(cfg, "data.tokenizer") is not None,
        fault_tolerant=cfg.fault_tolerance.name == "torchft",
    )
