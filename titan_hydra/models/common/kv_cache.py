"""Key/value cache for incremental decoding (``titan_hydra.generate``).

``Decoder.forward(tokens, cache=KVCache())`` processes only the new tokens: each attention layer
appends its new keys and values (after rotary, so cached keys never need re-rotating) to its
``LayerCache`` and attends from the new queries to everything cached. Positions continue from
``cache.length``: rotary tables are read from there, masks (causal, window, chunk) are built for
queries ``length .. length + new - 1`` against keys ``0 .. length + new - 1``, and Llama 4's NoPE
temperature uses the same absolute positions. One process, inference only; the cache grows
with the sequence (a sliding-window layer keeps keys it no longer needs: fine at the lengths
sampled here).
"""

from __future__ import annotations

import torch


class LayerCache:
    """One attention layer's keys and values, [B, T, H_kv, D] each (the projection layout), or a
    recurrent layer's ``state``."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        # a recurrent layer's state instead (Gated DeltaNet: GatedDeltaNetState), None before its first call
        self.state = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[1]

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new tokens' k/v; return all cached k/v (the new ones included)."""
        self.k = k if self.k is None else torch.cat([self.k, k], dim=1)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=1)
        return self.k, self.v


class KVCache:
    """Per-layer caches, keyed by the layer's name in ``model.layers``; ``length`` tokens so far."""

    def __init__(self) -> None:
        self.layers: dict[str, LayerCache] = {}
        self.length = 0

    def layer(self, name: str) -> LayerCache:
        return self.layers.setdefault(str(name), LayerCache())

    def advance(self, n: int) -> None:
        self.length += int(n)
