"""Pipeline-parallel schedule simulator: stage sizes and the order a rank runs F/B ops in.

Separate from the memory model because it is pure scheduling (which microbatches are in flight
when), mirroring parallel/pp.py's stage split and torch.distributed.pipelining's op order; the
CUDA memory model walks this order to find the worst moment of the worst rank.
"""

from __future__ import annotations

from titan_hydra.parallel.pp import default_stages_per_rank, stage_layer_ranges
from titan_hydra.planner.runtime import Runtime


def stage_layer_counts(dims, n_layers: int, runtime: Runtime) -> list[int]:
    """Layers of every pipeline stage, in stage order (titan_hydra's split or torchtitan's)."""
    if runtime.pp_split == "front" or dims.pp_split_points or dims.pp_layers_per_stage:
        return [len(r) for r in stage_layer_ranges(dims, n_layers)]
    n_stages = dims.pp * default_stages_per_rank(dims.pp_schedule)
    base, extra = divmod(n_layers, n_stages)  # torchtitan: first stage base, middle ones +1 first
    sizes = [base] + [base + (1 if s <= extra else 0) for s in range(1, n_stages - 1)]
    return sizes + [n_layers - sum(sizes)] if n_stages > 1 else [n_layers]


def pipeline_order(schedule: str, pp: int, rank: int, n_mb: int, n_local: int) -> list[tuple[str, int]]:
    """(F|B, local stage) in the order a rank runs them, as torch.distributed.pipelining does.

    1F1B: ``min(n_mb, pp - rank)`` warmup forwards, then backward-then-forward pairs, then the
    remaining backwards (the first stage holds up to pp microbatches). Interleaved 1F1B (and the
    other multi-stage schedules, approximated by it): ``(n_local - 1) * per_round + 2 * (pp - 1 -
    rank)`` warmup forwards (capped at all of them; torch's ``_get_warmup_ops``), then
    forward-then-backward pairs; forwards walk the local stages in rounds of ``per_round``
    microbatches, backwards walk them in reverse. GPipe: all forwards, then all backwards.
    """
    if n_local == 1:
        warm = n_mb if schedule == "GPipe" else min(n_mb, pp - rank)
        ops = [("F", 0)] * warm
        for _ in range(n_mb - warm):
            ops += [("B", 0), ("F", 0)]
        return ops + [("B", 0)] * warm
    total = n_mb * n_local
    per_round = n_mb // max(1, n_mb // pp)
    warm = min((n_local - 1) * per_round + 2 * (pp - 1 - rank), total)
    fwd = [("F", (i // per_round) % n_local) for i in range(total)]
    bwd = [("B", n_local - 1 - (i // per_round) % n_local) for i in range(total)]
    ops = fwd[:warm]
    for i in range(total - warm):
        ops += [fwd[warm + i], bwd[i]]
    return ops + bwd[total - warm:]
