"""Apply the configured layout to a meta-device model, in the order that composes.

float8 (done by the recipe) -> PP split -> per stage: TP -> EP -> AC -> compile -> FSDP/HSDP/DDP,
as torchtitan does: TP (and EP, for the routed experts) must see plain weights before FSDP wraps them in DTensors,
AC/compile wrap whole blocks, and FSDP goes last so that it shards whatever the others made.
Each technique lives in its own module and arrives here as an object built from its own
config group (``ParallelDims``, ``ActivationCheckpointing``, ``Compiler``); the model family
says what to shard and wrap. This file only decides the order, the per-microbatch context
(autocast, loss parallel, context-parallel sharding) and which runner drives the parts.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, ContextManager

import torch
from torch.distributed.tensor.parallel import loss_parallel

from titan_hydra.models.protocol import ShardsRope
from titan_hydra.parallel.cp import cp_context
from titan_hydra.parallel.parallelism import ParallelDims
from titan_hydra.parallel.ep import apply_ep
from titan_hydra.parallel.fsdp import apply_data_parallel
from titan_hydra.parallel.pp import build_pipeline
from titan_hydra.parallel.runner import ParallelModel, SingleStageRunner, batch_kwargs_for
from titan_hydra.parallel.tp import apply_tp


def parallelize_part(part: torch.nn.Module, family, dims: ParallelDims, ac, compiler, mixed_precision: str,
                     device: torch.device) -> torch.nn.Module:
    """TP -> EP -> AC -> compile -> data parallel on one model (or one pipeline stage).

    ``family`` (titan_hydra.models.protocol.ModelFamily) says what to shard and wrap: the TP
    plan, the routed experts, the blocks AC and compile wrap, the FSDP units.
    """
    if dims.tp_enabled:
        apply_tp(part, family, dims)
    experts = []
    if dims.ep_enabled:
        experts = [m for _, m in apply_ep(part, family, dims)]
    if ac is not None and ac.enabled:
        ac.apply(family.blocks(part))
    if compiler is not None and compiler.enabled:
        compiler.apply(part, family.blocks(part), [m for _, m in family.expert_modules(part)])
    if dims.fsdp_enabled or dims.dp_replicate_enabled:
        apply_data_parallel(part, family.fsdp_units(part), dims, mixed_precision, device, experts)
    return part


def uses_fsdp_mixed_precision(dims: ParallelDims) -> bool:
    """FSDP/HSDP cast parameters to bf16 themselves (MixedPrecisionPolicy); no autocast then."""
    return dims.fsdp_enabled


def make_step_context(parts: list[torch.nn.Module], family, dims: ParallelDims, mixed_precision: str,
                      device: torch.device):
    """The context each microbatch's forward(+backward) runs in."""
    bf16_autocast = mixed_precision == "bf16" and not uses_fsdp_mixed_precision(dims)
    rope_buffers = family.rope_buffers if isinstance(family, ShardsRope) else ()

    def step_context(inputs: torch.Tensor, labels: torch.Tensor) -> ContextManager:
        stack = contextlib.ExitStack()
        if dims.cp_enabled:
            stack.enter_context(cp_context(parts, rope_buffers, dims,
                                           family.objective.sequence_buffers(inputs, labels)))
        if dims.loss_parallel_enabled:
            stack.enter_context(loss_parallel())
        if bf16_autocast:
            stack.enter_context(torch.autocast(device_type=device.type, dtype=torch.bfloat16))
        return stack

    return step_context


def parallelize(model: torch.nn.Module, family, dims: ParallelDims, *, device: torch.device,
                mixed_precision: str, loss_fn: Callable, grad_accum_steps: int, ac=None,
                compiler=None, document_eos_id: int | None = None) -> ParallelModel:
    """This rank's model parts with every configured technique applied (still on meta), and
    the runner the trainer drives them with.

    ``loss_fn(logits, labels)`` is the training loss (compiled by ``compiler`` under
    ``compile=model_loss``); ``grad_accum_steps`` sets the runners' gradient scaling;
    ``document_eos_id`` (``data.document_mask``) makes the runners pass document ids.
    """
    batch_kwargs = batch_kwargs_for(document_eos_id)
    if compiler is not None:
        loss_fn = compiler.compile_loss(loss_fn)
    part_fn = functools.partial(parallelize_part, family=family, dims=dims, ac=ac, compiler=compiler,
                                mixed_precision=mixed_precision, device=device)
    context_fn = functools.partial(make_step_context, family=family, dims=dims,
                                   mixed_precision=mixed_precision, device=device)
    if dims.pp_enabled:
        return build_pipeline(model, family, dims, device, part_fn, context_fn,
                              grad_accum=grad_accum_steps, loss_fn=loss_fn, batch_kwargs=batch_kwargs)
    part = part_fn(model)
    return ParallelModel(model_parts=[part],
                         runner=SingleStageRunner(part, loss_fn, grad_accum_steps, context_fn([part]),
                                                  batch_kwargs))
