"""This rank's model: built on meta from the spec's args, kernels and float8 applied, laid out,
materialized and initialized; then its optimizer and LR schedule."""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from titan_hydra.kernels.attention_policy import apply_attention_kernel
from titan_hydra.kernels.attention_precision import apply_attention_precision
from titan_hydra.kernels.gated_delta_policy import apply_gated_delta_kernel, delta_layers
from titan_hydra.models.parametrization import Geometry, rescale_init
from titan_hydra.models.protocol import SizesSamples, WeighsLosses
from titan_hydra.models.registry import model_from_args
from titan_hydra.parallel.apply import parallelize
from titan_hydra.spec import RunSpec
from titan_hydra.train.built import BuiltModel, Optimization
from titan_hydra.train.mtp_metrics import mtp_loss_hooks
from titan_hydra.train.optimizers import build_optimizer, clean_name

FULL_INIT_MAX_PARAMS = 1.5e9


Materialize = Callable[[list[torch.nn.Module], torch.device], None]


def build_parallel_model(spec: RunSpec, device: torch.device, rank: int, dataset: Any, *,
                         materialize: Materialize | None = None,
                         kernel_device: torch.device | None = None) -> BuiltModel:
    """Model on meta -> attention precision -> float8 -> layout -> materialized and initialized.

    ``materialize(parts, device)`` replaces the weights' allocation and init (the simulator
    allocates fake tensors and draws nothing); ``kernel_device`` is the device whose attention
    kernels and precision the model takes when it differs from where tensors live (the simulator
    runs a GPU run's model on CPU fake tensors)."""
    dims, family, mp, training = spec.dims, spec.family, spec.mixed_precision, spec.training
    kernels_on = kernel_device or device
    with torch.device("meta"):
        model = model_from_args(spec.model_target, family, spec.model_args)
    seq_len = spec.batch.seq_len
    attention_dtype = apply_attention_precision(model, str(training.attention_precision), mp, kernels_on, seq_len)
    sdpa_dtype = attention_dtype or (torch.bfloat16 if mp == "bf16" else torch.float32)
    attention_kernel = apply_attention_kernel(model, str(training.attention_kernel), kernels_on, dims.cp,
                                              seq_len=seq_len // dims.cp, dtype=sdpa_dtype)
    if attention_kernel.name == "small_head":
        attention_dtype = torch.float32  # the kernel computes in fp32 whatever q/k/v arrive in
    delta_kernel = (apply_gated_delta_kernel(model, str(training.gated_delta_kernel), kernels_on)
                    if delta_layers(model) else None)
    model = spec.float8.convert(model)
    loss_fn = family.training_loss(spec.model_args)
    pm = parallelize(
        model, family, dims, device=device, mixed_precision=mp, loss_fn=loss_fn,
        grad_accum_steps=spec.batch.grad_accum, ac=spec.activation_checkpoint,
        compiler=spec.compiler, document_eos_id=getattr(dataset, "document_eos_id", None),
    )
    reweigh = None
    if isinstance(family, WeighsLosses):  # model-internal losses weigh like the main one
        reweigh = functools.partial(family.set_loss_scale, pm.model_parts)
        reweigh(pm.runner.loss_scale)
    geometry = spec.parametrization.geometry(family, spec.model_args)
    if materialize is None:
        init_weights(spec, pm.model_parts, device, rank, geometry)
    else:
        materialize(pm.model_parts, device)
    return BuiltModel(family, spec.model_args, pm.model_parts, pm.runner, spec.float8,
                      flops_per_unit(family, spec.model_args, dataset), attention_dtype, attention_kernel,
                      loss_hooks=mtp_loss_hooks(loss_fn, dims, lambda: pm.runner.loss_scale, device),
                      delta_kernel=delta_kernel, geometry=geometry, reweigh=reweigh)


def flops_per_unit(family: Any, args: Any, dataset: Any) -> float:
    """Training FLOPs per unit the objective counts (MFU's numerator): a ``SizesSamples`` family's
    own count, else per token of the dataset's ``seq_len`` (which sets the attention share)."""
    if isinstance(family, SizesSamples):
        return family.flops_per_unit(args, dataset)
    return family.flops_per_token(args, int(dataset.seq_len))


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
    seed = spec.training.seed
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
    mode = spec.training.init_mode
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
            full = model_from_args(spec.model_target, spec.family, spec.model_args)
            torch.manual_seed(seed)  # after construction: same RNG stream as the meta path above
            full.init_weights()
            rescaled(full, geometry or {})
        full_sd = full.state_dict()
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=spec.world_size > 1, strict=False)
    for part in parts:
        set_model_state_dict(part, dict(full_sd), options=options)  # a copy: DSD rewrites the dict it gets
    torch.manual_seed(seed)


def optimization_of(spec: RunSpec, built: BuiltModel) -> Optimization:
    """Optimizer over this rank's parameters and its LR schedule."""
    named = [(name, p) for part in built.parts for name, p in part.named_parameters()]
    optimizer = build_optimizer(spec.optimizer, named, built.geometry)
    built.float8.register(optimizer, built.parts)  # float8 scale precompute after each optimizer step
    return Optimization(optimizer, spec.lr_scheduler(optimizer, spec.training.steps, spec.batch.schedule.step_factor))
