"""Expert parallelism: the routed experts of every MoE layer are split over the ``ep`` ranks, and
each token travels to the rank that owns the expert it was routed to, and back.

Why it is built this way:

* The model knows nothing of EP. Its routed-experts module (``GroupedExperts``) is called with
  the tokens sorted by expert and the token count of each expert; ``ExpertParallel`` is a
  torch ``ParallelStyle`` that hooks exactly that call. Its pre-hook turns "my tokens, sorted
  by global expert" into "every ep peer's tokens for my experts, sorted by local expert" (an
  all-to-all of the counts, then an all-to-all of the tokens with uneven splits), and its
  post-hook sends the results back in the original order. The same module thus runs with
  ``E`` experts in one process and ``E/ep`` under EP.
* The weights ``w1/w2/w3`` [E, ...] become DTensors ``Shard(0)`` over the ep mesh (checkpoints
  and the full-state init see the full [E, ...] tensors). The module takes its local part
  itself (``to_local()``, differentiable, in ``GroupedExperts.weights_in``), so the gradient
  flows back into the DTensor parameter. The hooks leave the module's attributes alone:
  parameters shadowed by their local tensors during the forward only would break selective
  activation checkpointing (its recompute, run without the shadows, makes ``to_local`` views the
  forward never recorded, which torch refuses).
* The token all-to-all is an autograd function whose backward is the reverse all-to-all, so
  the gradient of every token comes back to the rank that sent it. It uses plain
  ``dist.all_to_all_single`` (gloo and NCCL both take uneven split sizes).
* Every rank of an ep group must run the same MoE layers in the same order (they meet in the
  all-to-all): true for data parallel, activation-checkpoint recompute and pipeline schedules,
  since the ep group lies inside one pipeline stage's data-parallel ranks.

It lives in the models layer, below ``parallel/ep.py`` (which applies it), so that a family whose
experts take another call signature builds its own style from the same pieces
(``models/hf/ep.py``: transformers' experts, called with each token's top-k experts).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from titan_hydra.errors import ConfigError


# --------------------------------------------------------------------------- the collective


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` with uneven splits; backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(grad.contiguous(), in_splits, out_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Send rows ``x[sum(in_splits[:j]) : ...+in_splits[j]]`` to group rank j; receive
    ``out_splits[j]`` rows from each rank j, concatenated in rank order. Differentiable."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


# --------------------------------------------------------------------------- dispatch / combine


def plan_dispatch(counts: torch.Tensor, ep: int, group) -> tuple[list[int], list[int], torch.Tensor]:
    """From this rank's tokens per global expert ``counts`` [E]: (tokens to send to each ep rank,
    tokens to receive from each, received counts [ep, E/ep] by (source rank, local expert))."""
    send = counts.to(torch.int64).reshape(ep, -1).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # row j of send goes to rank j
    return send.sum(1).tolist(), recv.sum(1).tolist(), recv


def local_expert_order(recv: torch.Tensor) -> torch.Tensor:
    """Permutation that reorders received rows from (source rank, local expert) blocks to
    (local expert, source rank) blocks, i.e. sorted by local expert, stable within each."""
    ep, local = recv.shape
    block = torch.arange(ep * local, device=recv.device).repeat_interleave(recv.flatten())
    source, expert = block // local, block % local
    return torch.argsort(expert * ep + source, stable=True)


class ExpertParallel(ParallelStyle):
    """Shards a routed-experts module's parameters ``Shard(0)`` over the ep mesh and wraps its
    forward(x sorted by global expert, counts per global expert) with the token all-to-alls.
    Apply with ``parallelize_module(experts, ep_mesh, ExpertParallel())``."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(module, device_mesh, partition_fn=self._partition,
                                 input_fn=self._dispatch, output_fn=self._combine)

    @staticmethod
    def _partition(name: str, module: nn.Module, mesh) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            if param.shape[0] % mesh.size():
                raise ConfigError(
                    f"parallelism.ep={mesh.size()} must divide the {param.shape[0]} experts of "
                    f"{name or 'the experts module'}.{pname}"
                )
            dparam = nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]), requires_grad=param.requires_grad)
            module.register_parameter(pname, dparam)

    @staticmethod
    def _dispatch(module: nn.Module, inputs: tuple, mesh) -> tuple:
        x, counts, *rest = inputs
        group = mesh.get_group()
        send, recv_splits, recv = plan_dispatch(counts, mesh.size(), group)
        received = all_to_all(x, recv_splits, send, group)
        order = local_expert_order(recv)
        module._ep_state = (torch.argsort(order), send, recv_splits)
        # A rank that no peer routed a token to still runs its experts, on zero rows: FSDP and
        # the backward all-to-alls need every rank (unit test "ep2_idle_rank").
        return (received.index_select(0, order), recv.sum(0).to(counts.dtype), *rest)

    @staticmethod
    def _combine(module: nn.Module, output: torch.Tensor, mesh) -> torch.Tensor:
        inverse, send, recv_splits = module._ep_state
        module._ep_state = None
        return all_to_all(output.index_select(0, inverse), send, recv_splits, mesh.get_group())
