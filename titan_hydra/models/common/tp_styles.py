"""ParallelStyles that torch does not ship, used by the families' tensor-parallel plans.

A plan (which module is sharded how) is model knowledge, so these live beside
``decoder_family.DecoderFamily.tp_plan``; a model defined outside this package imports them from
here too. Importing this module imports ``torch.distributed.tensor``.

* ``ReplicateParallel``: a module kept whole whose parameters must still be DTensors on the TP
  mesh (norms without sequence parallel). Gradient clipping's foreach norm and FSDP's 2-D
  sharding refuse a mix of plain tensors and DTensors.
* ``HeadShardedNorm``: a per-head norm (Qwen3's QK-norm) applied to the local heads after a
  column-wise projection. Its input is marked ``Shard(2)`` (heads of [B, S, H, D]) and its weight
  ``Replicate``, so the weight's gradient, a sum over every head, is all-reduced across TP ranks
  by DTensor. Marking the input ``Replicate`` would compute the right forward but keep each rank's
  partial weight gradient, silently wrong.
* ``PrepareInputShardParams``: ``PrepareModuleInput`` that also shards named parameters the module
  reads directly (not through a submodule's call) on dim 0 (a Gated DeltaNet's per-channel
  convolutions and per-head decays). The module reads their local part (``layers.local_part``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel.style import ParallelStyle, PrepareModuleInput


def _replicate_params(_name: str, module: nn.Module, mesh) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        if isinstance(param, DTensor):
            continue
        dt = DTensor.from_local(param, mesh, [Replicate()], run_check=False)
        module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))


def _to_local(_mod, out, _mesh):
    return out.to_local() if isinstance(out, DTensor) else out


def _inputs_as(placement):
    def fn(_mod: nn.Module, inputs: tuple, mesh) -> tuple:
        return tuple(
            DTensor.from_local(x, mesh, [placement], run_check=False)
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
            else x
            for x in inputs
        )

    return fn


class ReplicateParallel(ParallelStyle):
    """Keep a module unsharded with Replicate DTensor parameters; plain tensors in and out."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(module, device_mesh, partition_fn=_replicate_params,
                                 input_fn=_inputs_as(Replicate()), output_fn=_to_local)


class HeadShardedNorm(ParallelStyle):
    """A norm over head_dim applied to this rank's heads (input [B, S, H_local, D])."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(module, device_mesh, partition_fn=_replicate_params,
                                 input_fn=_inputs_as(Shard(2)), output_fn=_to_local)


class PrepareInputShardParams(PrepareModuleInput):
    """``PrepareModuleInput`` (same arguments) + ``params``: names under the module (dotted ones in
    its submodules) whose tensors are split on dim 0 into Shard(0) DTensors. One plan key thus
    gathers a mixer's input and shards what it reads directly."""

    def __init__(self, *, params: tuple[str, ...], **kwargs):
        super().__init__(**kwargs)
        self.params = params

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        for name in self.params:
            path, _, leaf = name.rpartition(".")
            owner = module.get_submodule(path)
            param = getattr(owner, leaf)
            dt = distribute_tensor(param, device_mesh, [Shard(0)])
            owner.register_parameter(leaf, nn.Parameter(dt, requires_grad=param.requires_grad))
        return super()._apply(module, device_mesh)


def _gather_sequence(x):
    if isinstance(x, DTensor):
        return x.redistribute(placements=[Replicate()]).to_local()
    return x


class GatherSequence(ParallelStyle):
    """Sequence parallel's entry into a sub-layer whose call signature the plan does not know
    (positional or keyword ``hidden_states``): every sequence-sharded DTensor argument is
    all-gathered and handed in as a plain tensor; the sub-layer's row-wise output projection
    scatters it back. ``scatter_output``: a sub-layer that runs whole on every rank (no row-wise
    projection) hands back its shard of the sequence itself."""

    def __init__(self, scatter_output: bool = False):
        super().__init__()
        self.scatter_output = scatter_output

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def hook(_mod, args, kwargs):
            return (tuple(_gather_sequence(a) for a in args),
                    {k: _gather_sequence(v) for k, v in kwargs.items()})

        def scatter(_mod, _args, out):
            first = out[0] if isinstance(out, tuple) else out
            sharded = DTensor.from_local(first, device_mesh, [Replicate()], run_check=False).redistribute(
                placements=[Shard(1)])
            return (sharded, *out[1:]) if isinstance(out, tuple) else sharded

        module.register_forward_pre_hook(hook, with_kwargs=True)
        if self.scatter_output:
            module.register_forward_hook(scatter)
        return module
