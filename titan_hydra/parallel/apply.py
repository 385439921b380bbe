"""Apply the configured layout to a meta-device model, in the order that composes.

float8 -> (PP split) -> TP -> AC -> compile -> FSDP/HSDP/DDP, as torchtitan does: TP must
see plain nn.Linear weights before FSDP wraps them in DTensors, AC/compile wrap whole blocks,
and FSDP goes last so that it shards whatever the other techniques produced.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

import torch
from omegaconf import DictConfig

from titan_hydra.parallel.dims import ParallelDims


@dataclass
class ParallelModel:
    """What the trainer needs from the layout."""

    model_parts: list[torch.nn.Module]
    step_context: Callable[[torch.Tensor, torch.Tensor], ContextManager]
    pp_schedule: Any = None
    pp_has_first_stage: bool = True
    pp_has_last_stage: bool = True
    notes: list[str] = field(default_factory=list)


def autocast_context(device: torch.device, mixed_precision: str, params_in_bf16: bool):
    """bf16 autocast when mixed precision is asked for and FSDP does not already cast params."""
    if mixed_precision != "bf16" or params_in_bf16:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def parallelize(model: torch.nn.Module, dims: ParallelDims, cfg: DictConfig, device: torch.device) -> ParallelModel:
    """Return the model parts of this rank with every configured technique applied (still on meta)."""
    mixed_precision = str(cfg.training.mixed_precision.value if hasattr(cfg.training.mixed_precision, "value") else cfg.training.mixed_precision)
    if dims.world_size > 1:
        raise NotImplementedError("multi-process layouts are added by the parallelism modules")
    autocast = autocast_context(device, mixed_precision, params_in_bf16=False)

    def step_context(inputs: torch.Tensor, labels: torch.Tensor) -> ContextManager:
        return autocast()

    return ParallelModel(model_parts=[model], step_context=step_context)
