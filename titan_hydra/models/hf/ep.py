"""Expert parallelism for transformers' experts modules (``model=hf``).

transformers' MoE layers call their experts module as ``experts(hidden [T, H], top_k_index
[T, K], top_k_weights [T, K])`` and the module routes inside its forward (eager loop or grouped
GEMM, ``config._experts_implementation``). ``TopKExpertParallel`` is the ep style for that call,
built from the same pieces as the native ``ExpertParallel`` (``models/common/expert_parallel``):

* its parameters (``gate_up_proj`` [E, ...], ``down_proj`` [E, ...], any per-expert bias) become
  DTensors ``Shard(0)`` over the ep mesh, so checkpoints, the full-state init and FSDP see the
  architecture's own [E, ...] tensors;
* the pre-hook flattens the (token, k) pairs, sorts them by expert and sends each row with its
  routing weight to the rank owning the expert (uneven all-to-all); the module then runs on
  those rows with k = 1 and local expert indices, and the post-hook sends the weighted rows back
  and sums each token's K rows (the sum transformers' own implementations end with);
* the module computes with its local weights through a view (``LocalExperts``) handed to
  transformers' implementation as ``self``: its parameters stay the DTensors (no shadowing
  during forward, see expert_parallel.py), and each forward takes ``to_local()`` (the gradient
  flows back into the DTensor), in the rows' dtype (the CPU layout leaves fp32 experts out of
  FSDP while the rest computes in bf16, parallel/fsdp.py).

The routing weights travel with the rows, so the router's gradient comes back through the
all-to-all like the tokens'. A rank that no peer sends a row to still touches its weights
(zero gradients): FSDP and the gradient norm meet every rank.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from titan_hydra.models.common import expert_parallel, moe
from titan_hydra.models.common.expert_parallel import ExpertParallel, all_to_all


class LocalExperts:
    """The experts module as its implementation reads it, with this rank's parameters (local
    shards, in ``dtype``) and expert count; every other attribute is the module's."""

    def __init__(self, module: nn.Module, dtype: torch.dtype):
        params = dict(module.named_parameters(recurse=False))
        local = {n: _local(p, dtype) for n, p in params.items()}
        self.__dict__.update(local, _module=module, num_experts=next(iter(local.values())).shape[0],
                             _locals=list(local.values()))

    def __getattr__(self, name: str):
        return getattr(self.__dict__["_module"], name)


def _local(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    p = p.to_local() if hasattr(p, "to_local") else p
    return p if p.dtype == dtype or not p.is_floating_point() else p.to(dtype)


class _LocalForward:
    """Mixed into an experts class under EP: its forward runs on the local view."""

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        view = LocalExperts(self, hidden.dtype)
        out = super().forward.__func__(view, hidden, top_k_index, top_k_weights)
        if hidden.shape[0] == 0:  # no rows: keep the weights in the graph (zero gradients, every rank reduces)
            out = out + sum(p.sum() for p in view._locals) * 0
        return out


@functools.lru_cache(maxsize=None)
def local_class(cls: type) -> type:
    return type(f"EP{cls.__name__}", (_LocalForward, cls), {"__module__": __name__})


class TopKExpertParallel(ExpertParallel):
    """``ExpertParallel`` for experts called with (hidden [T, H], top_k_index [T, K],
    top_k_weights [T, K]). Apply with ``parallelize_module(experts, ep_mesh, TopKExpertParallel())``."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        module.__class__ = local_class(type(module))
        return super()._apply(module, device_mesh)

    @staticmethod
    def _dispatch(module: nn.Module, inputs: tuple, mesh) -> tuple:
        hidden, top_k_index, top_k_weights = inputs
        tokens, k = top_k_index.shape
        n_experts = next(module.parameters()).shape[0]  # the global count: parameters are DTensors
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, k) pairs sorted by global expert
        # the native MoE's functions, looked up at call time: a static-shape count (bincount's output
        # size is data) and the dispatch plan, which the simulator swaps for balanced routing
        counts = moe.expert_counts(flat, n_experts)
        group = mesh.get_group()
        send, recv_splits, recv = expert_parallel.plan_dispatch(counts, mesh.size(), group)
        rows = all_to_all(hidden.index_select(0, order // k), recv_splits, send, group)
        weights = all_to_all(top_k_weights.reshape(-1).index_select(0, order), recv_splits, send, group)
        local_order = expert_parallel.local_expert_order(recv)
        per_local = recv.sum(0)
        local_index = torch.repeat_interleave(torch.arange(per_local.numel(), device=hidden.device), per_local,
                                              output_size=sum(recv_splits))  # known on the host: no sync
        module._ep_state = (torch.argsort(order), torch.argsort(local_order), send, recv_splits, tokens, k)
        return (rows.index_select(0, local_order), local_index.to(top_k_index.dtype).unsqueeze(1),
                weights.index_select(0, local_order).unsqueeze(1))

    @staticmethod
    def _combine(module: nn.Module, output: torch.Tensor, mesh) -> torch.Tensor:
        unsort, inverse, send, recv_splits, tokens, k = module._ep_state
        module._ep_state = None
        back = all_to_all(output.index_select(0, inverse), send, recv_splits, mesh.get_group())
        return back.index_select(0, unsort).view(tokens, k, -1).sum(1)
