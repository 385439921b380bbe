"""Rotary position embeddings as real cos/sin tables, in both pairings the field uses.

Tables are plain fp32 tensors (not complex): complex buffers do not mix well with DTensor and
DCP. Two layouts exist in published checkpoints and both are kept native here, so conversion
never has to permute weights it does not have to:

* interleaved (Meta's Llama reference): dims (2i, 2i+1) form a rotating pair;
* half (Hugging Face ``rotate_half``, Qwen): dims (i, i + head_dim/2) form a pair.

Frequency scaling variants (Llama 3.1's low-frequency scaling; YaRN for DeepSeek-V2/V3)
transform the inverse frequencies; YaRN also names a magnitude multiplier for the tables.
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


def llama3_scaled(freqs: torch.Tensor, factor: float, low_freq_factor: float = LLAMA3_LOW_FREQ_FACTOR,
                  high_freq_factor: float = LLAMA3_HIGH_FREQ_FACTOR,
                  original_context: int = LLAMA3_ORIGINAL_CONTEXT) -> torch.Tensor:
    """Llama 3.1 scaling: divide long wavelengths by ``factor``, keep short ones, blend between.

    Local positional resolution is untouched while the usable context grows. Llama 4 Scout uses
    the same rule with low = high frequency factor 1 (a hard cut at the original context).
    """
    wavelen = 2 * math.pi / freqs
    low_wavelen = original_context / low_freq_factor
    high_wavelen = original_context / high_freq_factor
    scaled = freqs / factor
    if high_freq_factor == low_freq_factor:
        mid = scaled  # no blend band: [high_wavelen, low_wavelen] is a single point
    else:
        smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        mid = (1 - smooth) * scaled + smooth * freqs
    return torch.where(wavelen > low_wavelen, scaled, torch.where(wavelen < high_wavelen, freqs, mid))


def tables_from_frequencies(freqs: torch.Tensor, max_seq_len: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_seq_len, head_dim/2] (fp32) for positions 0..max_seq_len-1."""
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), freqs.float().to(device))
    return angles.cos(), angles.sin()


def fit_tables(cos: torch.Tensor, sin: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole tables [max_seq_len, D/2] cut to the first ``seq_len`` positions; per-token tables
    [B, S, D/2] (document masking: positions restart per document) are already fitted."""
    return (cos[:seq_len], sin[:seq_len]) if cos.dim() == 2 else (cos, sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = True) -> torch.Tensor:
    """Rotate x [B, S, H, D] by position: tables [S, D/2] (shared by the batch) or [B, S, D/2]
    (per token). Computed in fp32 and cast back (reference numerics under bf16)."""
    xf = x.float()
    if interleaved:
        xf = xf.unflatten(-1, (-1, 2))
        x0, x1 = xf[..., 0], xf[..., 1]
    else:
        x0, x1 = xf.chunk(2, dim=-1)
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    r0, r1 = x0 * c - x1 * s, x0 * s + x1 * c
    out = torch.stack((r0, r1), dim=-1).flatten(-2) if interleaved else torch.cat((r0, r1), dim=-1)
    return out.type_as(x)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 when not extending)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_frequencies(rotary_dim: int, theta: float, factor: float, original_max_seq_len: int,
                     beta_fast: float = 32.0, beta_slow: float = 1.0, mscale: float = 1.0,
                     mscale_all_dim: float = 0.0, device=None, truncate: bool = True) -> tuple[torch.Tensor, float]:
    """YaRN (DeepSeek-V2/V3): (inverse frequencies [rotary_dim/2] fp32, cos/sin multiplier).

    Pairs that turn more than ``beta_fast`` times over the original context keep their frequency
    (extrapolate), pairs that turn fewer than ``beta_slow`` times are divided by ``factor``
    (interpolate), with a linear ramp over the pair index between the two (bounds floored/ceiled;
    ``truncate=False`` keeps them fractional, as GPT-OSS's config asks).
    The multiplier is mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set,
    else mscale(factor); DeepSeek's configs set mscale == mscale_all_dim, so it is 1 there and the
    magnitude correction lives in the softmax scale instead (``DeepSeekV3Args.softmax_scale``).

    Computed in fp32 in the order transformers uses (``_compute_yarn_parameters``), so the tables
    equal its ``DeepseekV3RotaryEmbedding`` bit for bit rather than to within rounding.
    """
    half = rotary_dim // 2

    def pair_index_of(turns: float) -> float:
        # the (fractional) pair index whose wavelength fits `turns` times into the original context
        return rotary_dim * math.log(original_max_seq_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_index_of(beta_fast), pair_index_of(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(half, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # weight of the original (extrapolated) frequency per pair
    wavelength_base = theta ** (torch.arange(0, rotary_dim, 2, device=device).float() / rotary_dim)
    original = 1.0 / wavelength_base
    stretched = 1.0 / (factor * wavelength_base)
    freqs = stretched * (1 - keep) + original * keep
    if mscale and mscale_all_dim:
        multiplier = float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
    else:
        multiplier = yarn_mscale(factor)
    return freqs, multiplier


def check_rotary_heads(n_heads: int, n_kv_heads: int | None, head_dim: int) -> None:
    """The head rules of a rotary attention's args, as one-line ValueErrors naming the key: kv heads
    that group the query heads evenly, and a head dim rotary can pair."""
    if n_kv_heads is not None and (n_kv_heads < 1 or n_heads % n_kv_heads):
        raise ValueError(f"model.n_kv_heads={n_kv_heads} must divide model.n_heads={n_heads}")
    if head_dim % 2 or head_dim <= 0:
        raise ValueError(f"model.head_dim={head_dim} must be even and positive for rotary")
