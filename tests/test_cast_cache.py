"""Expert weights cast once per optimizer step (models/common/cast_cache.py): the same numbers as
casting on every use, through recompute, accumulation, fused optimizer steps and in-place writes."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from titan_hydra.models.common import cast_cache
from titan_hydra.models.common.moe import GroupedExperts


def experts_and_batch(seed: int = 0):
    torch.manual_seed(seed)
    experts = GroupedExperts(16, 24, 4, bucket_rows=False)
    experts.init_weights(0.1, 0.1)
    counts = torch.tensor([5, 0, 9, 6])
    return experts, torch.randn(20, 16), counts


def train(experts, x, counts, steps: int, micro: int = 1, recompute: bool = False) -> list[float]:
    opt = torch.optim.AdamW(experts.parameters(), lr=1e-2, fused=True)
    losses = []
    for _ in range(steps):
        total = 0.0
        for m in range(micro):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                xs = x * (1 + m)
                y = checkpoint(experts, xs, counts, use_reentrant=False) if recompute else experts(xs, counts)
                loss = y.float().square().mean()
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


@pytest.mark.parametrize("micro, recompute", [(1, False), (2, False), (1, True), (2, True)])
def test_cached_casts_train_exactly_as_casting_every_use(monkeypatch, micro, recompute):
    a, x, counts = experts_and_batch()
    cached = train(a, x, counts, steps=4, micro=micro, recompute=recompute)
    b, _, _ = experts_and_batch()
    monkeypatch.setattr(cast_cache.WeightCastCache, "cast", lambda self, key, w, dtype: w.to(dtype))
    plain = train(b, x, counts, steps=4, micro=micro, recompute=recompute)
    assert cached == plain and len(set(cached)) == 4  # bit for bit, and the weights did move
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_a_copy_is_reused_within_a_step_and_dropped_by_any_optimizer_step():
    experts, x, counts = experts_and_batch()
    opt = torch.optim.AdamW(experts.parameters(), lr=1e-2, fused=True)  # fused: no version bump
    with torch.autocast("cpu", dtype=torch.bfloat16):
        experts(x, counts).float().sum().backward()
        first = experts.cast_cache._copies[0][2]
        experts(x, counts)
        assert experts.cast_cache._copies[0][2] is first
    opt.step()
    assert not experts.cast_cache._copies
    with torch.autocast("cpu", dtype=torch.bfloat16):
        experts(x, counts)
    assert torch.equal(experts.cast_cache._copies[0][2], experts.w1.detach().to(torch.bfloat16))
    with torch.no_grad():
        experts.w1.mul_(2.0)  # any in-place write bumps the version: cast again
    with torch.autocast("cpu", dtype=torch.bfloat16):
        experts(x, counts)
    assert torch.equal(experts.cast_cache._copies[0][2], experts.w1.detach().to(torch.bfloat16))


def test_fp32_runs_cache_nothing():
    experts, x, counts = experts_and_batch()
    experts(x, counts).square().sum().backward()
    assert not experts.cast_cache._copies and experts.w1.grad is not None
