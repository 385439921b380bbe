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


def block_split(args: ModelShape) -> tuple[float, float]:
    """(dense parameters of a block on average, routed experts of one MoE layer): the two parts
    FSDP shards on different meshes under expert parallelism."""
    expert_layer = args.expert_params / args.moe_layers
    return args.block_params - args.expert_params / args.n_layers, expert_layer


def largest_block_params(args: ModelShape, ep: int = 1) -> float:
    """Parameters FSDP unshards at once for one block: the dense part plus a MoE layer's routed
    experts, of which expert parallelism keeps only 1/ep on a rank (sharded on their own mesh)."""
    if not args.moe_layers:
        return args.block_params
    dense, experts = block_split(args)
    return dense + experts / max(ep, 1)


def largest_reduce_group_params(args: ModelShape, ep: int = 1) -> float:
    """Parameters of the largest FSDP group of one block, whose unsharded gradients exist at once
    in backward. Under expert parallelism the routed experts are a group of their own (on the
    expert mesh), reduce-scattered when their backward ends, before the rest of the block's
    gradients are made; without it the block is one group."""
    if not args.moe_layers or ep <= 1:
        return largest_block_params(args, ep)
    dense, experts = block_split(args)
    return max(dense, experts / ep)


def expert_shard_padding(args: ModelShape, dims) -> float:
    """Parameters one rank holds beyond its even share because FSDP2 shards the routed experts'
    stacked weights on dim 0 (the experts) and pads it to a multiple of the shard count: with
    fewer local experts (n_experts / ep) than ranks sharing them (efsdp), each rank holds one
    whole expert row, not a fraction (deepseek_v3_671b at ep 32 on 2,048 ranks: 8 local experts
    over efsdp 64, 8x the even share, simulated). 0 without FSDP or experts."""
    if not args.moe_layers or not args.n_experts or not dims.fsdp_enabled:
        return 0.0
    ep = int(getattr(dims, "ep", 1))
    local, shard = args.n_experts / ep, dims.dp_shard * dims.cp // ep
    padded = math.ceil(local / shard) - local / shard
    if padded <= 0:
        return 0.0
    layers = math.ceil(args.moe_layers / dims.pp)
    per_expert = args.expert_params / args.moe_layers / args.n_experts  # one expert of one layer
    return layers * per_expert * padded / (dims.tp if ep == 1 else 1)
