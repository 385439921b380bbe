"""Apply the configured layout to a meta-device model, in the order that composes.

float8 (done by the recipe) -> PP split -> per stage: TP -> AC -> compile -> FSDP/HSDP/DDP,
as torchtitan does: TP must see plain nn.Linear weights before FSDP wraps them in DTensors,
AC/compile wrap whole blocks, and FSDP goes last so that it shards whatever the others made.
Each technique lives in its own module; this file only decides the order and what the
trainer's per-step context is (autocast, loss parallel, context-parallel sharding).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

import torch
from omegaconf import DictConfig

from titan_hydra.config import mixed_precision_of

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




def parallelize_part(part: torch.nn.Module, family, dims: ParallelDims, cfg: DictConfig,
                     device: torch.device) -> torch.nn.Module:
    """TP -> AC -> compile -> data parallel on one model (or one pipeline stage).

    ``family`` (titan_hydra.models.protocol.ModelFamily) says what to shard and wrap: the TP
    plan, the blocks AC and compile wrap, the FSDP units.
    """
    if dims.tp_enabled:
        from titan_hydra.parallel.tp import apply_tp

        apply_tp(part, family, dims)
    if cfg.activation_checkpoint.mode != "none":
        from titan_hydra.parallel.ac import apply_ac

        apply_ac(family.blocks(part), cfg.activation_checkpoint)
    if cfg.compile.mode != "none":
        from titan_hydra.parallel.compile import apply_compile

        apply_compile(part, family.blocks(part), cfg.compile)
    if dims.fsdp_enabled or dims.dp_replicate_enabled:
        from titan_hydra.parallel.fsdp import apply_data_parallel

        apply_data_parallel(part, family.fsdp_units(part), dims, cfg, device)
    return part


def uses_fsdp_mixed_precision(dims: ParallelDims) -> bool:
    """FSDP/HSDP cast parameters to bf16 themselves (MixedPrecisionPolicy); no autocast then."""
    return dims.fsdp_enabled


def make_step_context(parts: list[torch.nn.Module], family, dims: ParallelDims, cfg: DictConfig, device: torch.device):
    """The context each microbatch's forward+backward runs in."""
    bf16_autocast = mixed_precision_of(cfg) == "bf16" and not uses_fsdp_mixed_precision(dims)

    def step_context(inputs: torch.Tensor, labels: torch.Tensor) -> ContextManager:
        stack = contextlib.ExitStack()
        if dims.cp_enabled:
            from titan_hydra.parallel.cp import cp_context

            stack.enter_context(cp_context(parts, family.rope_buffers, dims, inputs, labels))
        if dims.loss_parallel_enabled:
            from torch.distributed.tensor.parallel import loss_parallel

            stack.enter_context(loss_parallel())
        if bf16_autocast:
            stack.enter_context(torch.autocast(device_type=device.type, dtype=torch.bfloat16))
        return stack

    return step_context


def parallelize(model: torch.nn.Module, family, dims: ParallelDims, cfg: DictConfig,
                device: torch.device) -> ParallelModel:
    """Return this rank's model parts with every configured technique applied (still on meta)."""
    if dims.pp_enabled:
        from titan_hydra.parallel.pp import build_pipeline

        return build_pipeline(model, family, dims, cfg, device, parallelize_part, make_step_context)
    part = parallelize_part(model, family, dims, cfg, device)
    return ParallelModel(model_parts=[part], step_context=make_step_context([part], family, dims, cfg, device))
