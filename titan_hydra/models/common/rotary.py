"""Rotary position embeddings as real cos/sin tables, in both pairings the field uses.

Tables are plain fp32 tensors (not complex): complex buffers do not mix well with DTensor and
DCP. Two layouts exist in published checkpoints and both are kept native here, so conversion
never has to permute weights it does not have to:

* interleaved (Meta's Llama reference): dims (2i, 2i+1) form a rotating pair;
* half (Hugging Face ``rotate_half``, Qwen): dims (i, i + head_dim/2) form a pair.

Frequency scaling variants (Llama 3.1's low-frequency scaling today; YaRN for later families)
transform the inverse frequencies and nothing else.
"""

from __future__ import annotations

import math

import torch

# Llama 3.1 rope-scaling constants (the scale factor itself is a model field).
LLAMA3_LOW_FREQ_FACTOR = 1.0
LLAMA3_HIGH_FREQ_FACTOR = 4.0
LLAMA3_ORIGINAL_CONTEXT = 8192


def inverse_frequencies(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """theta^(-2i/head_dim) for i < head_dim/2, computed in fp64."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim))


def llama3_scaled(freqs: torch.Tensor, factor: float) -> torch.Tensor:
    """Llama 3.1 scaling: divide long wavelengths by ``factor``, keep short ones, blend between.

    Local positional resolution is untouched while the usable context grows.
    """
    wavelen = 2 * math.pi / freqs
    low_wavelen = LLAMA3_ORIGINAL_CONTEXT / LLAMA3_LOW_FREQ_FACTOR
    high_wavelen = LLAMA3_ORIGINAL_CONTEXT / LLAMA3_HIGH_FREQ_FACTOR
    smooth = (LLAMA3_ORIGINAL_CONTEXT / wavelen - LLAMA3_LOW_FREQ_FACTOR) / (
        LLAMA3_HIGH_FREQ_FACTOR - LLAMA3_LOW_FREQ_FACTOR
    )
    scaled = freqs / factor
    mid = (1 - smooth) * scaled + smooth * freqs
    return torch.where(wavelen > low_wavelen, scaled, torch.where(wavelen < high_wavelen, freqs, mid))


def tables_from_frequencies(freqs: torch.Tensor, max_seq_len: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_seq_len, head_dim/2] (fp32) for positions 0..max_seq_len-1."""
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), freqs.float().to(device))
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = True) -> torch.Tensor:
    """Rotate x [B, S, H, D] by position. Computed in fp32 and cast back (reference numerics under bf16)."""
    xf = x.float()
    if interleaved:
        xf = xf.unflatten(-1, (-1, 2))
        x0, x1 = xf[..., 0], xf[..., 1]
    else:
        x0, x1 = xf.chunk(2, dim=-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    r0, r1 = x0 * c - x1 * s, x0 * s + x1 * c
    out = torch.stack((r0, r1), dim=-1).flatten(-2) if interleaved else torch.cat((r0, r1), dim=-1)
    return out.type_as(x)
