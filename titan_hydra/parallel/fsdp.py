"""Data parallelism: FSDP2 (``fully_shard``), HSDP and DDP, all on torch's FSDP2 runtime.

Why one runtime for all three: FSDP, HSDP and DDP differ only in the data-parallel mesh and
in whether parameters are sharded. torch 2.13 ships an FSDP2-based ``replicate``
(``torch.distributed._composable.replicate_with_fsdp``) whose parameters are DTensors with a
``Replicate()`` placement, so DDP composes with TP (2-D DTensors), DCP checkpoints, the
DTensor-aware gradient clipping and ``get_model_state_dict`` exactly like FSDP does. The
classic ``DistributedDataParallel`` wrapper would hide the model behind ``.module`` (FQNs
change) and does not take DTensor parameters.

Grouping (one all-gather / reduce-scatter per group) is the model family's: for the decoders
token embeddings, each transformer block, norm+output together (tied models: embeddings, norm
and output as one group), then the root (which only owns what is left, e.g. nothing).

Reductions: gloo has no ``ReduceOp.PREMUL_SUM`` and no ``ReduceOp.AVG`` for these
collectives, which FSDP picks by default to average gradients. On gloo we force plain-SUM
collectives; FSDP then divides by the data-parallel size itself (before/after the sum), so
gradients stay the mean over dp ranks, matching the trainer's per-rank mean loss.

Expert parallel: routed-experts modules (already DTensors ``Shard(0)`` over ep, see ep.py) are
sharded first, on the expert mesh's efsdp dim (2-D with dp_replicate: HSDP), so that their
block's group (on the dense mesh) leaves them out. Their gradient already sums the
contributions of the whole ep group (the all-to-all's backward brings every token's gradient
to the expert's owner), and the efsdp (x dp_replicate) reduction sums over the rest, so the
divide factor is the full dp x cp size, exactly what the dense parameters are divided by.

On CPU, when no other rank holds the same experts (efsdp x dp_replicate = 1, e.g. ep over every
data-parallel rank), FSDP has nothing to shard or reduce for them, yet a group of one still
casts them to bf16 before every forward and backward and copies, divides and copies back their
gradients after it (17% of a Qwen3-MoE ep2 step on CPU). There the experts are left out of FSDP
(``ignored_params``): they stay fp32 ``Shard(0)`` DTensors over ep, the experts cast them to the
activations' dtype once per optimizer step (models/common/cast_cache.py), and their gradient is
divided by the dp x cp size (``divide_weight_gradients``). ``experts_need_fsdp`` says why GPUs
keep FSDP on them.
"""

from __future__ import annotations

import warnings

import torch


from titan_hydra.errors import ConfigError
from titan_hydra.parallel.parallelism import ParallelDims




def mp_policy_of(mixed_precision: str, dims: ParallelDims):
    """bf16: bf16 compute params, fp32 gradient reduction. DDP keeps fp32 params (apply.py autocasts)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mixed_precision == "bf16" and dims.fsdp_enabled:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)


def offload_policy_of(dims: ParallelDims, device: torch.device):
    """CPU offload. Pinned host memory needs an accelerator: CPUOffloadPolicy(pin_memory=True) fails on a CPU-only torch."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if dims.fsdp_cpu_offload:
        return CPUOffloadPolicy(pin_memory=device.type != "cpu")
    return OffloadPolicy()


def _shard_dim_name(mesh) -> str:
    """Name of the sharding dim in the world mesh: flattened dp_shard_cp, or whichever exists."""
    names = mesh.mesh_dim_names
    if "dp_shard" in names and "cp" in names:
        return "dp_shard_cp"
    return "dp_shard" if "dp_shard" in names else "cp"


def dp_mesh_of(dims: ParallelDims):
    """The mesh FSDP/HSDP/DDP runs on: 1-D shard, 2-D (replicate, shard), or 1-D replicate."""
    if not dims.fsdp_enabled:
        return dims.submesh("dp_replicate")
    if not dims.dp_replicate_enabled:
        return dims.submesh("dp_shard_cp")
    root = dims._mesh
    shard = _shard_dim_name(root)
    with warnings.catch_warnings():
        # torch 2.13 warns that slicing a flattened dim (dp_shard_cp) from the root mesh will be
        # deprecated; it still works and is the only way to pair it with dp_replicate in 2-D.
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        return root["dp_replicate", shard]


def block_reshard_after_forward(dims: ParallelDims, is_last: bool) -> bool:
    """``default``: reshard every block but the last (backward needs it at once); with PP never,
    since each microbatch would all-gather again."""
    policy = dims.fsdp_reshard_after_forward
    if policy == "always":
        return True
    if policy == "never":
        return False
    return not dims.pp_enabled and not is_last


def use_sum_reductions(model: torch.nn.Module) -> None:
    """Make every FSDP/replicate group reduce with ReduceOp.SUM (+ its own divide): gloo-safe."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def expert_dp_mesh_of(dims: ParallelDims):
    """The mesh expert modules are sharded on: efsdp, or (dp_replicate, efsdp) for HSDP."""
    return dims.expert_mesh("dp_replicate", "efsdp")


def _unit_is_last(units: list, module: torch.nn.Module) -> bool:
    """Whether ``module`` lies inside the unit that runs last in the forward."""
    for unit, is_last in units:
        for m in unit if isinstance(unit, list) else [unit]:
            if any(sub is module for sub in m.modules()):
                return is_last
    return False


def experts_need_fsdp(dims: ParallelDims, device: torch.device) -> bool:
    """Whether the routed experts get their own FSDP group: when other ranks hold the same
    experts (efsdp or dp_replicate > 1), parameters are offloaded to the host, or on GPUs. There
    FSDP frees each layer's bf16 copy of its experts after the layer, where without it every
    layer's copy would live through the backward (half the experts' fp32 bytes, ~7 GiB a rank
    for Qwen3-30B-A3B on 8 GPUs), and the copies it saves cost little time."""
    return dims.efsdp * dims.dp_replicate > 1 or dims.fsdp_cpu_offload or device.type != "cpu"


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def divide_weight_gradients(module: torch.nn.Module, factor: float) -> None:
    """Divide the gradients of ``module``'s weights by ``factor`` (what FSDP's reduction would
    divide them by), on the tokens' side: the gradient entering the module's output is divided
    and the one leaving its input multiplied back. Weight gradients are linear in the output
    gradient, so they come out divided, the input gradient unchanged; that touches the
    module's rows (~N x D per layer) instead of its weights (E x 3 x D x H, ~10x more on
    Qwen3-MoE, where a hook dividing the weight gradients cost 9% of the step). Exact when the
    factor is a power of two; otherwise one extra rounding of the gradient in the compute dtype.
    Every floating-point input is multiplied back: the rows, and routing weights where the module
    applies them itself (transformers' experts, models/hf/ep.py)."""
    module.register_forward_pre_hook(lambda _, args: tuple(
        _ScaleGradient.apply(a, factor) if torch.is_tensor(a) and a.is_floating_point() else a for a in args))
    module.register_forward_hook(lambda _, args, out: _ScaleGradient.apply(out, 1.0 / factor))


def leave_experts_out(experts: list[torch.nn.Module], factor: float) -> set[torch.nn.Parameter]:
    """The experts' parameters (FSDP's ``ignored_params``), with their gradients divided by
    ``factor`` (divide_weight_gradients)."""
    if factor != 1.0:
        for module in experts:
            divide_weight_gradients(module, factor)
    return {p for module in experts for p in module.parameters()}


def shard_experts(experts: list[torch.nn.Module], units: list, dims: ParallelDims, mp, offload) -> None:
    """FSDP on each routed-experts module (before its block), grads divided by the dp x cp size."""
    from torch.distributed.fsdp import fully_shard

    mesh = expert_dp_mesh_of(dims)
    for module in experts:
        reshard = block_reshard_after_forward(dims, _unit_is_last(units, module))
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=offload)
        module.set_gradient_divide_factor(float(dims.dp_replicate * dims.dp_shard * dims.cp))


def apply_data_parallel(model: torch.nn.Module, units: list, dims: ParallelDims, mixed_precision: str,
                        device: torch.device, experts: list[torch.nn.Module] = ()) -> None:
    """FSDP2 (dp_shard/cp > 1, 2-D HSDP with dp_replicate > 1) or FSDP2-based DDP, in place.

    ``units``: (module or [modules], is_last_in_forward) in forward order, from the model
    family (``ModelFamily.fsdp_units``); each becomes one all-gather / reduce-scatter group.
    ``experts``: routed-experts modules already sharded over ep (EP needs FSDP: ep | dp_shard*cp).
    """
    mesh = dp_mesh_of(dims)
    mp = mp_policy_of(mixed_precision, dims)
    if dims.fsdp_enabled:
        from torch.distributed.fsdp import fully_shard

        offload = offload_policy_of(dims, device)
        ignored = None
        if experts and not experts_need_fsdp(dims, device):
            ignored = leave_experts_out(list(experts), float(dims.dp_shard * dims.cp))
        else:
            shard_experts(list(experts), units, dims, mp, offload)
        for module, is_last in units:
            fully_shard(
                module,
                mesh=mesh,
                reshard_after_forward=block_reshard_after_forward(dims, is_last),
                mp_policy=mp,
                offload_policy=offload,
                ignored_params=ignored,
            )
        fully_shard(model, mesh=mesh, reshard_after_forward=None, mp_policy=mp, offload_policy=offload,
                    ignored_params=ignored)
    else:
        from torch.distributed._composable.replicate_with_fsdp import replicate

        for module, _ in units:
            replicate(module, mesh=mesh, mp_policy=mp)
        replicate(model, mesh=mesh, mp_policy=mp)
    if _backend_is_gloo():
        use_sum_reductions(model)
        if dims.efsdp == 1 and experts_need_fsdp(dims, device):
            # One rank per efsdp group: FSDP runs no reduce-scatter there, and torch 2.13 divides
            # such a gradient twice (by the factor, then again after the "sum"). The sum op is
            # only needed for gloo collectives, and the HSDP all-reduce is a SUM either way.
            for module in experts:
                module.set_force_sum_reduction_for_comms(False)


def _backend_is_gloo() -> bool:
    import torch.distributed as dist

    return dist.is_initialized() and dist.get_backend() == "gloo"


def check_layout(dims: ParallelDims) -> None:
    """Data-parallel settings that cannot work, each as a one-line ConfigError."""
    if dims.fsdp_cpu_offload and not dims.fsdp_enabled:
        raise ConfigError(
            "parallelism.fsdp_cpu_offload=true needs FSDP (parallelism.dp_shard > 1); set it to false"
        )
