"""What one checkpoint holds, and how this rank's part of a run becomes those entries.

Saving, loading and the HF import all need the same view of the run (its model parts,
optimizer, schedule, loader, progress, layout and model identity), so it lives here once, as
``RunParts``, instead of being threaded through each of them.

The entries (flat DCP keys, all tensors, see storage.py for why):

* ``model.<fqn>``            parameters, as this rank holds them (DTensor shards under FSDP/TP,
                             only its stages under PP); DCP records global shapes, so a
                             checkpoint saved under one layout loads under any other.
* ``ema.<fqn>``              the EMA of the weights (``training.ema_decay``; train/ema.py),
                             placed and resharded like ``model.<fqn>``; absent without EMA.
* ``optim.state.<fqn>.<k>``  optimizer state keyed by parameter FQN (layout independent).
* ``extra``                  JSON: train state, LR schedule, optimizer hyper-parameters,
                             data loader position (identical on every rank, written once).
* ``rank_state.<rank>``      JSON: python / numpy / torch RNG states of that rank (and a
                             streaming loader's per-rank state). Restored only under the same
                             world size and layout: RNG streams have no meaning across layouts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from titan_hydra.checkpoint.rng import get_rng_state
from titan_hydra.checkpoint.storage import CheckpointError, json_tensor
from titan_hydra.checkpoint.versions import FORMAT_VERSION
from titan_hydra.models.registry import LEGACY_FAMILY
from titan_hydra.version import project_version

# What ``checkpoint.exclude_from_loading`` may name (validate.py checks the config against it).
CATEGORIES = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng", "ema")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def export_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise CheckpointError(f"checkpoint.export_dtype={name!r}; use one of float32, bfloat16, float16")
    return DTYPES[name]


def members(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers behind ``optimizer`` (for DCP's state-dict functions).

    Duck-typed: a container of several optimizers (train/optimizers.py's ``OptimizerList``) lists
    them as ``optimizers``; anything else is one optimizer. Defined here, where DCP needs it, so
    that checkpointing does not depend on the training code."""
    return list(getattr(optimizer, "optimizers", [optimizer]))


def signature_diff(saved: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """Fields of two model signatures (``ModelFamily.signature``) that disagree; a checkpoint written
    before a field existed is not judged on it."""
    saved = {"family": LEGACY_FAMILY, **saved}
    return [f"{k}={saved[k]!r} (run has {v!r})" for k, v in ours.items() if k in saved and saved[k] != v]


class PartsView(nn.Module):
    """One module whose FQNs are those of several pipeline parts of the same model.

    torch's state-dict helpers take one module; a rank holding two stages (interleaved or
    V schedules) has two. Stages are cuts of one model: a ModuleDict of blocks (whatever the
    family calls it) holds disjoint keys in each stage, every other child lives in one stage.
    So children re-register under one parent, ModuleDicts merged by key, without renaming.
    """

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        for part in parts:
            for name, child in part.named_children():
                if child is None:
                    continue
                mine = self._modules.get(name)
                if isinstance(child, nn.ModuleDict):
                    if mine is None:
                        mine = nn.ModuleDict()
                        self.add_module(name, mine)
                    for key, block in child.items():
                        if key in mine:
                            raise ValueError(f"pipeline parts share {name}.{key}")
                        mine[key] = block
                elif mine is not None:
                    raise ValueError(f"pipeline parts share submodule {name!r}")
                else:
                    self.add_module(name, child)


def _jsonable(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str, list, tuple, dict))


@dataclass
class RunParts:
    """What the recipe built, as one rank sees it: the objects a checkpoint saves and restores,
    the parallel layout, and the model's identity (family, args, flavor)."""

    model_parts: list[nn.Module]
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    train_loader: Any
    train_state: Any  # the trainer's progress (step, tokens, losses)
    dims: Any  # titan_hydra.parallel.parallelism.ParallelDims
    family: Any  # titan_hydra.models.protocol.ModelFamily
    model_args: Any
    flavor: str
    rank: int = 0
    world_size: int = 1
    ema: Any = None  # train/ema.py's WeightEMA (``entries`` / ``load``), None without one

    # ------------------------------------------------------------------ this rank in the run
    def log(self, message: str) -> None:
        if self.rank == 0:
            print(f"[checkpoint] {message}", flush=True)

    def barrier(self) -> None:
        if dist.is_initialized() and self.world_size > 1:
            dist.barrier()

    @property
    def module(self) -> nn.Module:
        """The model as one module (torch's state-dict helpers take one)."""
        return self.model_parts[0] if len(self.model_parts) == 1 else PartsView(self.model_parts)

    def layout(self) -> dict[str, int]:
        d = self.dims
        out = {"pp": d.pp, "dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard, "cp": d.cp, "tp": d.tp}
        if getattr(d, "ep", 1) > 1:  # only when on, so markers of dense layouts read as before
            out["ep"] = d.ep
        return out

    def marker_info(self, step: int, kind: str, dtype: str) -> dict[str, Any]:
        """The completion marker's content (storage.write_marker adds the files' checksums)."""
        return {
            "format": FORMAT_VERSION,  # checkpoint/versions.py: what a load does with another
            "titan_hydra": project_version(),
            "step": step,
            "kind": kind,
            "dtype": dtype,
            "world_size": self.world_size,
            "layout": self.layout(),
            "model": {"family": self.family.name, "flavor": self.flavor,
                      "args": self.family.args_fields(self.model_args),
                      "signature": self.family.signature(self.model_args)},
            "time": time.time(),
        }

    # ------------------------------------------------------------------ state dicts
    def model_state(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        sd = get_model_state_dict(self.module)
        return {f"model.{k}": (v.to(dtype) if dtype is not None and v.is_floating_point() else v) for k, v in sd.items()}

    def ema_state(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """``ema.<fqn>`` entries of the EMA of the weights; {} without one."""
        entries = self.ema.entries() if self.ema is not None else {}
        return {f"ema.{k}": (v.to(dtype) if dtype is not None else v) for k, v in entries.items()}

    def optim_state(self) -> dict[str, Any]:
        options = StateDictOptions(flatten_optimizer_state_dict=True)
        return get_optimizer_state_dict(self.module, members(self.optimizer), options=options)

    def loader_state(self) -> tuple[dict | None, dict | None]:
        """(rank-independent loader state, per-rank loader state)."""
        sd = self.train_loader.state_dict() if hasattr(self.train_loader, "state_dict") else None
        if sd is None:
            return None, None
        shared = sd.get("rank_independent") or sd.get("kind") == "packed"  # packed: saved before the flag
        return (sd, None) if shared else (None, sd)

    def extra_state(self) -> dict[str, Any]:
        groups = [
            {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params" and _jsonable(v)}
            for g in self.optimizer.param_groups
        ]
        sched = {k: v for k, v in self.lr_scheduler.state_dict().items() if _jsonable(v)}
        shared_loader, _ = self.loader_state()
        return {
            "train_state": self.train_state.state_dict(),
            "lr_scheduler": sched,
            "optimizer_groups": groups,
            "dataloader": shared_loader,
        }

    def rank_state(self) -> dict[str, Any]:
        _, own_loader = self.loader_state()
        return {"rng": get_rng_state(), "dataloader": own_loader}

    def state_to_save(self, model_only: bool = False, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Every entry this rank writes (see the module docstring)."""
        sd = {**self.model_state(dtype), **self.ema_state(dtype)}
        if model_only:
            return sd
        for k, v in self.optim_state().items():
            if isinstance(v, torch.Tensor):
                sd[f"optim.{k}"] = v
        sd["extra"] = json_tensor(self.extra_state())
        sd[f"rank_state.{self.rank}"] = json_tensor(self.rank_state())
        return sd
