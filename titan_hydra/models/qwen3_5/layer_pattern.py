"""A hybrid model's layer types as one config value: an explicit list or an interval.

``model.layer_types`` lists one entry per layer (``linear_attention`` = Gated DeltaNet,
``full_attention`` = gated softmax attention), the form HF's config.json stores. Unset, the list
follows ``model.full_attention_interval=k``: every k-th layer is full attention (HF's rule,
``(i + 1) % k == 0``), so k=2, 4, 8 give 1:1, 3:1, 7:1 linear:full, k=1 all full and k=0 (ours)
all linear. Either is one override, and so sweepable with ``-m``:

    python launch.py -m model=qwen3_5_debug model.full_attention_interval=2,4,8

A bad value is one line naming the key (unknown type, list length not n_layers).
"""

from __future__ import annotations

LINEAR = "linear_attention"
FULL = "full_attention"
LAYER_TYPES = (LINEAR, FULL)


def resolve_layer_types(n_layers: int, layer_types: list[str] | None, interval: int) -> list[str]:
    """The per-layer list from ``model.layer_types`` (wins when set) or ``model.full_attention_interval``."""
    if layer_types is not None:
        types = [str(t) for t in layer_types]
        unknown = sorted({t for t in types if t not in LAYER_TYPES})
        if unknown:
            raise ValueError(f"model.layer_types has unknown types {unknown}; use {LINEAR} or {FULL}")
        if len(types) != n_layers:
            raise ValueError(f"model.layer_types has {len(types)} entries but model.n_layers={n_layers}; "
                             "give one type per layer (or null and model.full_attention_interval)")
        return types
    if interval < 0:
        raise ValueError(f"model.full_attention_interval={interval} must be >= 0 (0: no full-attention layer)")
    return [FULL if interval and (i + 1) % interval == 0 else LINEAR for i in range(n_layers)]

