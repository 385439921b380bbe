"""Model and stage sizes from the config alone: what every other planner module counts in.

Separate because both the memory model and ``parallelism=auto``'s step-time model need the same
parameter counts (per model, per pipeline stage, per FSDP unshard group) without building a model.
"""

from __future__ import annotations

import math

from titan_hydra.models.protocol import ModelShape


def stage_params(args: ModelShape, pp: int) -> float:
    """Parameters of the largest pipeline stage (blocks split evenly + embedding or output)."""
    if pp == 1:
        return args.params
    return math.ceil(args.n_layers / pp) * args.block_params + max(args.embedding_params, args.head_params)


def largest_block_params(args: ModelShape, ep: int = 1) -> float:
    """Parameters FSDP unshards at once for one block: the dense part plus a MoE layer's routed
    experts, of which expert parallelism keeps only 1/ep on a rank (sharded on their own mesh)."""
    if not args.moe_layers:
        return args.block_params
    expert_layer = args.expert_params / args.moe_layers
    dense_avg = args.block_params - args.expert_params / args.n_layers
    return dense_avg + expert_layer / max(ep, 1)
