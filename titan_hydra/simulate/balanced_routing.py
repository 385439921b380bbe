"""MoE routing for fake tensors: every expert gets the same number of tokens (the planner's
assumption), as concrete numbers.

A router's token counts are data: fake tensors have none, and expert parallelism needs them on
the host (the all-to-all's split sizes are Python lists). While a rank is simulated, the model's
count function returns balanced counts as a real tensor, the dispatch plan is the balanced one
(every ep peer sends this rank the same share, so the split sizes are lists of equal numbers; the
counts' own all-to-all is still issued, on a fake buffer, so it is counted), and the experts take
the GPU's path (grouped GEMM, rows not padded to CPU buckets) when the run targets a GPU.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily

from titan_hydra.models.common import expert_parallel, moe


def balanced_counts(selected: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens per expert when the (token, choice) pairs spread evenly (the first ``rem`` one more)."""
    base, rem = divmod(selected.numel(), num_experts)
    with unset_fake_temporarily():
        return torch.tensor([base + 1] * rem + [base] * (num_experts - rem), dtype=torch.int64)


def balanced_plan(counts: torch.Tensor, ep: int, group) -> tuple[list[int], list[int], torch.Tensor]:
    """``plan_dispatch`` when every ep peer routes like this one: it receives, for each of its local
    experts, what it would send that expert itself."""
    with unset_fake_temporarily():
        send = torch.as_tensor(counts.tolist(), dtype=torch.int64).reshape(ep, -1)
        mine = send[dist.get_rank(group)]
        recv = mine.expand(ep, -1).contiguous()
        send_splits, recv_splits = send.sum(1).tolist(), recv.sum(1).tolist()
    dist.all_to_all_single(torch.empty(send.shape, dtype=torch.int64), torch.empty(send.shape, dtype=torch.int64),
                           group=group)  # the counts' exchange, counted (fake buffers)
    return send_splits, recv_splits, recv


@contextlib.contextmanager
def balanced_routing(gpu: bool) -> Iterator[None]:
    """Balanced counts and dispatch while the block runs; ``gpu``: the experts run as on a GPU."""
    original = (moe.expert_counts, expert_parallel.plan_dispatch, expert_parallel.local_expert_order,
                moe.buckets_rows, moe.grouped_mm_works)
    order = original[2]

    def local_order(recv: torch.Tensor) -> torch.Tensor:
        with unset_fake_temporarily():
            return order(recv)

    moe.expert_counts, expert_parallel.plan_dispatch, expert_parallel.local_expert_order = (
        balanced_counts, balanced_plan, local_order)
    if gpu:
        moe.buckets_rows, moe.grouped_mm_works = (lambda device, dtype: False), (lambda device, dtype: True)
    try:
        yield
    finally:
        (moe.expert_counts, expert_parallel.plan_dispatch, expert_parallel.local_expert_order,
         moe.buckets_rows, moe.grouped_mm_works) = original
