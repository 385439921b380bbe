"""What one model configuration costs, read off the model itself: its parameters, the FLOPs a
training token takes, and the keys its queries attend to. Every family that counts a built model
(the native decoders, ``model=hf``) counts it here, so the numbers the planner, the dry run and
MFU see follow one rule.

* Parameters are counted on a meta build (no memory): exact by construction, no hand formula can
  drift from the code. A tied matrix is counted once in the total.
* Routed experts: a token uses ``top_k`` of ``n_experts`` of every routed-expert tensor, so the
  active count is ``total - expert_params x (1 - top_k / n_experts)`` (exact: the expert count
  divides each stacked tensor's size).
* FLOPs per token = 6 x (active parameters that are matmul weights) + attention's 12 x heads x
  head_dim per layer times the keys that layer's query meets (causal mask ignored, the common
  MFU convention). The input embedding is a lookup, not a matmul, unless it is tied to the output.
* Attended keys: ``seq_len`` in a full-attention layer, at most the window (or chunk) in a
  sliding (or chunked) one.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from titan_hydra.models.protocol import ModelShape

SLIDING = "sliding_attention"  # the layer type (HF ``layer_types``) whose keys a window bounds


def args_key(family: Any, args: Any) -> str:
    """``args`` as a hashable cache key: its fields as sorted JSON (a nested ``moe`` included)."""
    return json.dumps(family.args_fields(args), sort_keys=True)


def meta_build(family: Any, key: str) -> tuple[Any, nn.Module]:
    """(args, model) of the args ``key`` names (``args_key``), the model built on the meta device."""
    args = family.make_args(json.loads(key))
    with torch.device("meta"):
        return args, family.build(args)


def parameter_counts(model: nn.Module, embedding: torch.Tensor, head: Iterable[torch.Tensor],
                     experts: Sequence[nn.Module], n_experts: int, top_k: int) -> dict[str, int]:
    """The counting fields of ``ModelShape``: ``embedding`` is the input lookup table, ``head`` the
    tensors counted with the output head (final norm, projection, ...), ``experts`` the routed
    experts modules, of which each token uses ``top_k`` of ``n_experts`` (ignored without any)."""
    total = sum(p.numel() for p in model.parameters())  # parameters() yields a shared one once
    expert_params = sum(p.numel() for m in experts for p in m.parameters())
    n_experts, top_k = (int(n_experts), int(top_k)) if experts else (0, 0)
    idle = expert_params * (n_experts - top_k) // n_experts if n_experts else 0
    return {"params": total, "active_params": total - idle, "embedding_params": embedding.numel(),
            "head_params": sum(t.numel() for t in head), "expert_params": expert_params,
            "n_experts": n_experts, "top_k": top_k, "moe_layers": len(experts)}


def matmul_params(shape: ModelShape) -> int:
    """Active parameters a token multiplies by: the input embedding is a lookup, not a matmul,
    unless it is tied to the output."""
    return shape.active_params - (0 if shape.tied_embeddings else shape.embedding_params)


def flops_per_token(shape: ModelShape, attended_keys: int) -> float:
    """Training FLOPs (forward + backward) of one token: 6 x matmul parameters + attention's
    12 x heads x head_dim x the keys its queries meet, summed over the layers."""
    return float(6 * matmul_params(shape) + 12 * shape.n_heads * shape.head_dim * attended_keys)


def bounded_keys(bounds: Iterable[int | None], seq_len: int) -> int:
    """Keys one query meets, summed over the layers: ``seq_len``, or at most a layer's bound (its
    window or chunk; None or 0: unbounded)."""
    return sum(min(seq_len, b) if b else seq_len for b in bounds)


def attended_keys(layer_types: Iterable[str], window: int | None, seq_len: int) -> int:
    """``bounded_keys`` of layers named by type (HF ``layer_types``): a ``sliding_attention`` layer
    is bounded by ``window``, every other one sees the whole sequence."""
    return bounded_keys((window if t == SLIDING else None for t in layer_types), seq_len)
