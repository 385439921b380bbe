"""FLUX.1 (black-forest-labs dev / schnell): a rectified-flow MMDiT, parallelism-agnostic.

The network predicts the flow velocity of packed latent tokens (16 VAE channels x a 2x2 patch = 64
features per token), conditioned on T5 token embeddings (``txt``), a pooled CLIP vector (``y``),
the flow time ``t`` in [0, 1] and, for the guidance-distilled dev model, a guidance scale.

* Conditioning: ``vec = time_in(sin(1000 t)) [+ guidance_in(sin(1000 g))] + vector_in(y)``; every
  block reads ``vec`` through its own zero-initialized adaLN modulation (shift, scale, gate).
* Double-stream blocks keep separate weights for text and image tokens (modulation, q/k/v,
  QK RMSNorm, output projection, GELU-tanh MLP) but attend jointly over ``[txt, img]``.
* Single-stream blocks run on the concatenated sequence: q, k, v and the MLP input are read off
  the same tokens; attention output and MLP activation are projected back and summed.
* Positions are 3-axis ids (``(0, row, col)`` for image patches, zeros for text); each axis owns a
  slice of the head dim and rotates interleaved pairs (2i, 2i+1) by ``id * theta^(-2i/d_axis)``.

Layout choices (the converter in diffusers_io.py maps diffusers' names onto these): every projection
is its own linear (BFL's release fuses q/k/v, and the single blocks' four input and two output
projections; separate linears compute the same function and are what tensor parallel shards column-
or row-wise); every modulation output is ordered (shift, scale, gate) per sub-block, the final
layer's (shift, scale). Blocks take and return plain tensors, so the
engine can wrap each one (activation checkpointing, compile, FSDP) on its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from titan_hydra.models.common.layers import RMSNorm
from titan_hydra.models.common.rotary import apply_rope, inverse_frequencies

PATCH = 2  # FLUX packs 2x2 latent pixels into one token (the VAE's 16 channels become 64 features)
NORM_EPS = 1e-6  # every LayerNorm and QK RMSNorm of FLUX.1
TIME_FACTOR = 1000.0  # t in [0, 1] (and the guidance scale) are embedded as 1000 t, as FLUX was trained
MAX_PERIOD = 10000.0  # longest period of the sinusoidal timestep features


@dataclass(kw_only=True)
class FluxArgs:
    """Shape of a FLUX.1 MMDiT. Shape fields have no default: a flavor's shape lives in its
    conf/model/*.yaml only. ``qkv_bias`` applies to the double blocks' q/k/v; the single blocks'
    q/k/v always have a bias (FLUX.1 fuses them with the MLP input, which has one)."""

    dim: int
    n_heads: int
    n_double_blocks: int
    n_single_blocks: int
    context_dim: int
    pooled_dim: int
    in_channels: int
    mlp_ratio: float = 4.0
    axes_dim: list[int] = field(default_factory=lambda: [16, 56, 56])
    theta: int = 10000
    qkv_bias: bool = True
    guidance_embed: bool = False
    time_dim: int = 256

    def __post_init__(self) -> None:
        self.axes_dim = list(self.axes_dim)
        if self.dim % self.n_heads:
            raise ValueError(f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}")
        if len(self.axes_dim) != 3:
            raise ValueError(f"model.axes_dim={self.axes_dim} must have 3 entries (one per position-id axis)")
        if any(d <= 0 or d % 2 for d in self.axes_dim):
            raise ValueError(f"model.axes_dim={self.axes_dim} must hold positive even sizes (rotary turns pairs)")
        if sum(self.axes_dim) != self.head_dim:
            raise ValueError(f"model.axes_dim={self.axes_dim} sums to {sum(self.axes_dim)}, not the head dim "
                             f"model.dim/model.n_heads={self.head_dim}")
        if self.time_dim <= 0 or self.time_dim % 2:
            raise ValueError(f"model.time_dim={self.time_dim} must be a positive even number (sin/cos halves)")
        if self.mlp_hidden_dim <= 0:
            raise ValueError(f"model.mlp_ratio={self.mlp_ratio} gives an empty MLP at model.dim={self.dim}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def mlp_hidden_dim(self) -> int:
        return int(self.dim * self.mlp_ratio)


# --- positions and latent packing -----------------------------------------------------------


def image_ids(height_patches: int, width_patches: int, batch: int | None = None, device=None) -> torch.Tensor:
    """Position ids (0, row, col) of a row-major patch grid: [h*w, 3], or [batch, h*w, 3]."""
    rows = torch.arange(height_patches, device=device, dtype=torch.float32)
    cols = torch.arange(width_patches, device=device, dtype=torch.float32)
    grid = torch.stack(torch.meshgrid(rows, cols, indexing="ij"), dim=-1).reshape(-1, 2)
    ids = torch.cat((torch.zeros_like(grid[:, :1]), grid), dim=-1)
    return ids if batch is None else ids.expand(batch, -1, -1)


def text_ids(length: int, batch: int | None = None, device=None) -> torch.Tensor:
    """Position ids of text tokens: all zeros (T5 already encodes order), [length, 3] or [batch, length, 3]."""
    ids = torch.zeros(length, 3, device=device)
    return ids if batch is None else ids.expand(batch, -1, -1)


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """VAE latents [B, C, H, W] -> tokens [B, H/2 * W/2, 4C]: patches row-major, each patch's
    features ordered (channel, dy, dx), as diffusers' ``FluxPipeline._pack_latents``."""
    b, c, h, w = latents.shape
    if h % PATCH or w % PATCH:
        raise ValueError(f"latent height {h} and width {w} must be even to pack 2x2 patches")
    x = latents.reshape(b, c, h // PATCH, PATCH, w // PATCH, PATCH)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(b, (h // PATCH) * (w // PATCH), c * PATCH * PATCH)


def unpatchify(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of ``patchify``: tokens [B, h/2 * w/2, 4C] -> latents [B, C, h, w] (h, w in latent pixels)."""
    b, n, d = tokens.shape
    if h % PATCH or w % PATCH or n != (h // PATCH) * (w // PATCH) or d % (PATCH * PATCH):
        raise ValueError(f"{n} tokens of {d} features do not tile a {h}x{w} latent in 2x2 patches")
    x = tokens.reshape(b, h // PATCH, w // PATCH, d // (PATCH * PATCH), PATCH, PATCH)
    return x.permute(0, 3, 1, 4, 2, 5).reshape(b, d // (PATCH * PATCH), h, w)


def rope_tables(ids: torch.Tensor, axes_dim: list[int], theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [..., L, head_dim/2] (fp32) for position ids [..., L, n_axes]: axis a rotates its
    ``axes_dim[a]`` dims by ``id_a * theta^(-2i/axes_dim[a])``. Angles are formed in fp64, as BFL's
    and diffusers' code does, so the fp32 tables equal theirs rather than differing in the last bits."""
    angles = [ids[..., a, None].double() * inverse_frequencies(d, theta, ids.device) for a, d in enumerate(axes_dim)]
    angles = torch.cat(angles, dim=-1)
    return angles.cos().float(), angles.sin().float()


def joint_ids(txt_ids: torch.Tensor, img_ids: torch.Tensor) -> torch.Tensor:
    """Ids of the joint [txt, img] sequence: [L, 3] if both are shared by the batch, else [B, L, 3]."""
    if txt_ids.dim() == img_ids.dim() == 2:
        return torch.cat((txt_ids, img_ids), dim=0)
    batch = max(ids.shape[0] for ids in (txt_ids, img_ids) if ids.dim() == 3)
    return torch.cat((txt_ids.expand(batch, -1, -1), img_ids.expand(batch, -1, -1)), dim=1)


def timestep_features(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal features [B, dim] of (already scaled) times t [B]: cos half first, then sin, with
    frequencies MAX_PERIOD^(-i/(dim/2)); computed in fp32."""
    half = dim // 2
    freqs = torch.exp(-math.log(MAX_PERIOD) / half * torch.arange(half, device=t.device, dtype=torch.float32))
    args = t.float()[:, None] * freqs[None]
    return torch.cat((args.cos(), args.sin()), dim=-1)


# --- building blocks ------------------------------------------------------------------------


def layer_norm(x: torch.Tensor) -> torch.Tensor:
    """Affine-free LayerNorm in fp32 (the adaLN shift/scale supply the affine part)."""
    return F.layer_norm(x.float(), (x.shape[-1],), eps=NORM_EPS).type_as(x)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN: norm(x) * (1 + scale) + shift, with per-sample shift/scale [B, D] over tokens [B, L, D]."""
    return layer_norm(x) * (1 + scale[:, None]) + shift[:, None]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> torch.Tensor:
    """Full (non-causal) attention of q, k, v [B, L, H, D] with rotary q/k -> [B, L, H*D]."""
    q, k = apply_rope(q, cos, sin, interleaved=True), apply_rope(k, cos, sin, interleaved=True)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2).flatten(2)


class MLPEmbedder(nn.Module):
    """in_layer -> SiLU -> out_layer: lifts timestep features or the pooled text vector to ``dim``."""

    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.in_layer = nn.Linear(in_dim, dim)
        self.out_layer = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_layer(F.silu(self.in_layer(x)))


class MLP(nn.Module):
    """fc1 -> GELU(tanh) -> fc2, the feed-forward of each double-block stream."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class StreamAttention(nn.Module):
    """One stream's share of a joint attention: q, k, v projections, per-head QK RMSNorm, output
    projection. Heads are read off the projected width (``head_dim`` is fixed), so column-sharded
    q/k/v (tensor parallel: whole heads per rank) need no change here."""

    def __init__(self, dim: int, head_dim: int, qkv_bias: bool):
        super().__init__()
        self.head_dim = head_dim
        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.k = nn.Linear(dim, dim, bias=qkv_bias)
        self.v = nn.Linear(dim, dim, bias=qkv_bias)
        self.q_norm = RMSNorm(head_dim, NORM_EPS)
        self.k_norm = RMSNorm(head_dim, NORM_EPS)
        self.proj = nn.Linear(dim, dim)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [B, L, H, head_dim] of tokens x [B, L, dim], q and k normalized."""
        q, k, v = (lin(x).unflatten(-1, (-1, self.head_dim)) for lin in (self.q, self.k, self.v))
        return self.q_norm(q), self.k_norm(k), v


class DoubleStreamBlock(nn.Module):
    """Text and image tokens with their own weights, one attention over [txt, img].

    ``forward(img, txt, vec, cos, sin) -> (img, txt)``; cos/sin cover the [txt, img] sequence.
    """

    def __init__(self, args: FluxArgs):
        super().__init__()
        self.img_mod = nn.Linear(args.dim, 6 * args.dim)
        self.img_attn = StreamAttention(args.dim, args.head_dim, args.qkv_bias)
        self.img_mlp = MLP(args.dim, args.mlp_hidden_dim)
        self.txt_mod = nn.Linear(args.dim, 6 * args.dim)
        self.txt_attn = StreamAttention(args.dim, args.head_dim, args.qkv_bias)
        self.txt_mlp = MLP(args.dim, args.mlp_hidden_dim)

    def forward(self, img: torch.Tensor, txt: torch.Tensor, vec: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cond = F.silu(vec)
        i_shift1, i_scale1, i_gate1, i_shift2, i_scale2, i_gate2 = self.img_mod(cond).chunk(6, dim=-1)
        t_shift1, t_scale1, t_gate1, t_shift2, t_scale2, t_gate2 = self.txt_mod(cond).chunk(6, dim=-1)
        iq, ik, iv = self.img_attn.heads(modulate(img, i_shift1, i_scale1))
        tq, tk, tv = self.txt_attn.heads(modulate(txt, t_shift1, t_scale1))
        out = attention(torch.cat((tq, iq), 1), torch.cat((tk, ik), 1), torch.cat((tv, iv), 1), cos, sin)
        txt_out, img_out = out.split((txt.shape[1], img.shape[1]), dim=1)
        img = img + i_gate1[:, None] * self.img_attn.proj(img_out)
        img = img + i_gate2[:, None] * self.img_mlp(modulate(img, i_shift2, i_scale2))
        txt = txt + t_gate1[:, None] * self.txt_attn.proj(txt_out)
        txt = txt + t_gate2[:, None] * self.txt_mlp(modulate(txt, t_shift2, t_scale2))
        return img, txt


class SingleStreamBlock(nn.Module):
    """Parallel attention + MLP over the joint sequence: q, k, v and the MLP input are projections
    of the same modulated tokens; the block's output is ``attn_out(attention) + mlp_out(GELU(mlp_in))``.
    FLUX.1 fuses the four input projections into one linear and the two output ones into one linear
    over the concatenation [attention | MLP]; kept apart here (same function: the converter splits
    and joins the fused tensors), each is a plain column- or row-wise linear for tensor parallel.
    ``forward(x, vec, cos, sin) -> x``."""

    def __init__(self, args: FluxArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.mod = nn.Linear(args.dim, 3 * args.dim)
        self.q = nn.Linear(args.dim, args.dim)
        self.k = nn.Linear(args.dim, args.dim)
        self.v = nn.Linear(args.dim, args.dim)
        self.mlp_in = nn.Linear(args.dim, args.mlp_hidden_dim)
        self.q_norm = RMSNorm(args.head_dim, NORM_EPS)
        self.k_norm = RMSNorm(args.head_dim, NORM_EPS)
        self.attn_out = nn.Linear(args.dim, args.dim, bias=False)  # the fused output linear's one bias: mlp_out's
        self.mlp_out = nn.Linear(args.mlp_hidden_dim, args.dim)

    def forward(self, x: torch.Tensor, vec: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shift, scale, gate = self.mod(F.silu(vec)).chunk(3, dim=-1)
        h = modulate(x, shift, scale)
        q, k, v = (lin(h).unflatten(-1, (-1, self.head_dim)) for lin in (self.q, self.k, self.v))
        out = attention(self.q_norm(q), self.k_norm(k), v, cos, sin)
        mlp = F.gelu(self.mlp_in(h), approximate="tanh")
        return x + gate[:, None] * (self.attn_out(out) + self.mlp_out(mlp))


class FinalLayer(nn.Module):
    """adaLN (shift, scale) then a linear back to the packed latent features."""

    def __init__(self, dim: int, out_dim: int):
        super().__init__()
        self.mod = nn.Linear(dim, 2 * dim)
        self.linear = nn.Linear(dim, out_dim)

    def forward(self, x: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        shift, scale = self.mod(F.silu(vec)).chunk(2, dim=-1)
        return self.linear(modulate(x, shift, scale))


# --- the model -------------------------------------------------------------------------------


class Flux(nn.Module):
    """``Flux(dim=3072, n_heads=24, ...)``: fields of ``FluxArgs`` (conf/model/flux*.yaml)."""

    def __init__(self, **fields):
        super().__init__()
        self.args = a = FluxArgs(**fields)
        self.img_in = nn.Linear(a.in_channels, a.dim)
        self.txt_in = nn.Linear(a.context_dim, a.dim)
        self.time_in = MLPEmbedder(a.time_dim, a.dim)
        self.guidance_in = MLPEmbedder(a.time_dim, a.dim) if a.guidance_embed else None
        self.vector_in = MLPEmbedder(a.pooled_dim, a.dim)
        self.double_blocks = nn.ModuleDict({str(i): DoubleStreamBlock(a) for i in range(a.n_double_blocks)})
        self.single_blocks = nn.ModuleDict({str(i): SingleStreamBlock(a) for i in range(a.n_single_blocks)})
        self.final_layer = FinalLayer(a.dim, a.in_channels)

    def forward(self, img: torch.Tensor, img_ids: torch.Tensor, txt: torch.Tensor, txt_ids: torch.Tensor,
                timesteps: torch.Tensor, y: torch.Tensor, guidance: torch.Tensor | None = None) -> torch.Tensor:
        """Velocity [B, L_img, in_channels] of packed latents ``img`` [B, L_img, in_channels].

        ``txt`` [B, L_txt, context_dim]: T5 states; ``y`` [B, pooled_dim]: pooled CLIP vector;
        ``timesteps`` [B] in [0, 1]; ``guidance`` [B]: the guidance scale (e.g. 3.5), given iff the
        model has ``guidance_embed``. Position ids are [L, 3] (shared by the batch) or [B, L, 3].
        """
        if (guidance is None) == self.args.guidance_embed:
            raise ValueError("guidance must be given exactly when model.guidance_embed is true "
                             f"(guidance_embed={self.args.guidance_embed})")
        img = self.img_in(img)
        txt = self.txt_in(txt)
        vec = self.time_in(self.time_features(timesteps, img.dtype))
        if self.guidance_in is not None:
            vec = vec + self.guidance_in(self.time_features(guidance, img.dtype))
        vec = vec + self.vector_in(y)
        cos, sin = rope_tables(joint_ids(txt_ids, img_ids), self.args.axes_dim, self.args.theta)

        for block in self.double_blocks.values():
            img, txt = block(img, txt, vec, cos, sin)
        x = torch.cat((txt, img), dim=1)
        for block in self.single_blocks.values():
            x = block(x, vec, cos, sin)
        return self.final_layer(x[:, txt.shape[1]:], vec)

    def time_features(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Sinusoidal features of 1000 t (a time in [0, 1], or a guidance scale) in the compute dtype."""
        return timestep_features(t * TIME_FACTOR, self.args.time_dim).to(dtype)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """Initialize every parameter from the current torch RNG (the model holds no buffers, so
        ``buffer_device`` is accepted for the engine's protocol and unused).

        Meant to run after ``to_empty`` on a meta-built model. DiT's adaLN-Zero recipe:

        * every modulation linear and the final layer start at zero: all gates are 0, so each block
          is the identity and the model outputs exactly 0 (velocity 0) at step 0; gradients still
          reach the gates (they multiply non-zero branch outputs) and the final linear (it reads
          the non-zero normalized stream), so training moves them off zero at once;
        * the other linears are Xavier-uniform with zero bias, which keeps token activations at
          unit scale through the projections whatever their fan-in/fan-out;
        * the timestep/guidance/pooled-vector MLPs are N(0, 0.02), as in DiT: ``vec`` reaches only
          the zero-initialized modulations, whose first updates scale with it, so a small ``vec``
          keeps those first steps gentle;
        * QK RMSNorm weights are 1.
        """
        embedders = [m for m in (self.time_in, self.guidance_in, self.vector_in) if m is not None]
        zero = [self.final_layer.mod, self.final_layer.linear]
        for block in self.double_blocks.values():
            zero += [block.img_mod, block.txt_mod]
        for block in self.single_blocks.values():
            zero.append(block.mod)
        embedder_linears = {id(m) for e in embedders for m in e.modules()}
        zero_ids = {id(m) for m in zero}
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.reset_parameters()
            elif isinstance(module, nn.Linear):
                if id(module) in zero_ids:
                    nn.init.zeros_(module.weight)
                elif id(module) in embedder_linears:
                    nn.init.normal_(module.weight, std=0.02)
                else:
                    nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
