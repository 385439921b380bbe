"""Parallelism-agnostic Llama 2/3 decoder.

The model knows nothing about FSDP, TP, PP or CP; those are applied from outside by
addressing submodules by their FQNs (``tok_embeddings``, ``layers.<i>.attention.wq``, ...).
Two small concessions make that possible:

* Attention derives its local head counts from the projected tensor shapes, so a
  column-wise sharded ``wq/wk/wv`` (tensor parallel) just yields fewer local heads.
* ``tok_embeddings`` / ``norm`` / ``output`` may be ``None`` and entries of the
  ``layers`` ModuleDict may be deleted, which is how pipeline stages are cut; forward
  then passes hidden states through instead of tokens/logits.

Rotary embeddings are kept as real cos/sin tables (non-persistent buffers) rather than a
complex tensor, because complex buffers do not mix well with DTensor and DCP.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titan_hydra.models.flavors import FLAVORS

# Llama 3.1 rope-scaling constants (the scale factor itself is a LlamaArgs field).
ROPE_LOW_FREQ_FACTOR = 1.0
ROPE_HIGH_FREQ_FACTOR = 4.0
ROPE_ORIGINAL_CONTEXT = 8192


@dataclass
class LlamaArgs:
    """Shape and init hyper-parameters of a Llama model (Meta's field names)."""

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None -> n_heads (multi-head attention)
    vocab_size: int = 128256
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: bool = False  # Llama 3.1/3.2 low-frequency rope scaling
    rope_scaling_factor: float = 8.0  # 8 for Llama 3.1, 32 for Llama 3.2
    max_seq_len: int = 8192
    depth_init: bool = True  # scale output-projection init std by layer depth

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads={self.n_heads} not divisible by n_kv_heads={self.kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU hidden size exactly as Meta computes it (2/3 of 4*dim, scaled, rounded up)."""
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


# --------------------------------------------------------------------------- rotary


def rope_frequencies(args: LlamaArgs, device: torch.device | str | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] in fp32, with Llama 3.1 scaling if enabled.

    Scaling divides the low-frequency (long-wavelength) components by the factor, keeps
    high-frequency ones, and interpolates smoothly in between, so local positional
    resolution is untouched while the usable context grows.
    """
    hd = args.head_dim
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, hd, 2, device=device, dtype=torch.float64) / hd))
    if args.rope_scaling:
        wavelen = 2 * math.pi / freqs
        low_wavelen = ROPE_ORIGINAL_CONTEXT / ROPE_LOW_FREQ_FACTOR
        high_wavelen = ROPE_ORIGINAL_CONTEXT / ROPE_HIGH_FREQ_FACTOR
        smooth = (ROPE_ORIGINAL_CONTEXT / wavelen - ROPE_LOW_FREQ_FACTOR) / (
            ROPE_HIGH_FREQ_FACTOR - ROPE_LOW_FREQ_FACTOR
        )
        scaled = freqs / args.rope_scaling_factor
        mid = (1 - smooth) * scaled + smooth * freqs
        freqs = torch.where(wavelen > low_wavelen, scaled, torch.where(wavelen < high_wavelen, freqs, mid))
    return freqs.float()


def rope_tables(args: LlamaArgs, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_seq_len, head_dim/2] (fp32) for positions 0..max_seq_len-1."""
    freqs = rope_frequencies(args, device)
    angles = torch.outer(torch.arange(args.max_seq_len, device=device, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, S, H, D] by position; Meta's interleaved layout pairs dims (2i, 2i+1).

    Computed in fp32 and cast back, matching Meta's reference numerics under bf16.
    """
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    return out.type_as(x)


# --------------------------------------------------------------------------- modules


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 (stable under bf16), then scaled by a learned weight."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def _trunc_normal_(w: torch.Tensor, std: float) -> None:
    """Normal(0, std) truncated at +-3 std (keeps rare large weights out of the init)."""
    nn.init.trunc_normal_(w, mean=0.0, std=std, a=-3 * std, b=3 * std)


class Attention(nn.Module):
    """Causal grouped-query attention via SDPA.

    Head counts are read off the projected shapes at runtime so that column-wise
    sharding of wq/wk/wv (tensor parallel) works without the module knowing about it.
    """

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.head_dim = args.head_dim
        # dtype SDPA runs in; None = whatever q/k/v arrive in (the compute dtype). A training
        # precision policy may set float32 (titan_hydra.train.precision).
        self.sdpa_dtype: torch.dtype | None = None
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        # The tables arrive whole: only here is the true sequence length known (a pipeline
        # stage's input may be sequence-sharded by TP and gathered just before attention).
        cos, sin = cos[:seqlen], sin[:seqlen]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        n_rep = q.shape[2] // k.shape[2]
        if n_rep > 1:  # kv head j serves query heads j*n_rep .. (j+1)*n_rep-1, as in Meta's repeat_kv
            k = k.repeat_interleave(n_rep, dim=2)
            v = v.repeat_interleave(n_rep, dim=2)
        out = self._sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dtype = self.sdpa_dtype
        if dtype is None or q.dtype == dtype:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        with torch.autocast(q.device.type, enabled=False):  # keep autocast from casting back
            out = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), is_causal=True)
        return out.to(q.dtype)

    def init_weights(self, out_std: float) -> None:
        for w in (self.wq, self.wk, self.wv):
            _trunc_normal_(w.weight, 0.02)
        _trunc_normal_(self.wo.weight, out_std)


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, out_std: float) -> None:
        _trunc_normal_(self.w1.weight, 0.02)
        _trunc_normal_(self.w3.weight, 0.02)
        _trunc_normal_(self.w2.weight, out_std)


class TransformerBlock(nn.Module):
    """Pre-norm block: h = x + attn(norm(x)); out = h + ffn(norm(h))."""

    def __init__(self, layer_id: int, args: LlamaArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        # Residual-branch output projections start smaller in deeper models/layers so the
        # residual stream's variance does not grow with depth at init.
        depth = (layer_id + 1) if args.depth_init else args.n_layers
        self.out_std = 0.02 / math.sqrt(2 * depth)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention.init_weights(self.out_std)
        self.feed_forward.init_weights(self.out_std)
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()


class Llama3(nn.Module):
    """Llama 2/3 decoder with untied input/output embeddings.

    ``Llama3(flavor="llama3_8b", max_seq_len=4096)`` starts from a published shape and
    applies field overrides; ``flavor="custom"`` uses LlamaArgs defaults plus the fields.
    """

    def __init__(self, flavor: str = "custom", **fields):
        super().__init__()
        if flavor != "custom" and flavor not in FLAVORS:
            raise KeyError(f"unknown Llama flavor {flavor!r}; known: custom, {', '.join(FLAVORS)}")
        self.flavor = flavor
        self.args = args = LlamaArgs(**{**FLAVORS.get(flavor, {}), **fields})
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # ModuleDict (not ModuleList) so pipeline stages can delete layers and keep FQNs.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        cos, sin = rope_tables(args)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, S] -> logits [B, S, vocab].

        On a pipeline stage without ``tok_embeddings`` the input is hidden states
        [B, S, dim]; without ``output`` the return value is hidden states.
        """
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        cos, sin = self.rope_cos, self.rope_sin
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """(Re)build rope tables and initialize every present parameter.

        Meant to run after ``to_empty`` on a meta-built (possibly sharded / staged) model.
        Token embeddings use std 1.0 (Meta/torchtitan convention): the first RMSNorm
        rescales them anyway, and a unit-scale residual stream keeps the small (0.02)
        residual branches near identity at init. The output layer uses dim**-0.5 so the
        initial logits are O(1) regardless of width.
        """
        if buffer_device is None:
            buffer_device = next((p.device for p in self.parameters()), self.rope_cos.device)
        self.rope_cos, self.rope_sin = rope_tables(self.args, buffer_device)
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=1.0)
        for layer in self.layers.values():
            layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            _trunc_normal_(self.output.weight, self.args.dim**-0.5)


# --------------------------------------------------------------------------- counting


def build_from_args(args: LlamaArgs) -> Llama3:
    """Build a model from an existing LlamaArgs (flavor recorded as "custom")."""
    return Llama3("custom", **asdict(args))


def num_params(args: LlamaArgs, exclude_embedding: bool = False) -> int:
    """Analytic parameter count (no allocation) of the untied model.

    ``exclude_embedding`` drops only the token-embedding table (a lookup, no FLOPs);
    the output projection is a real matmul and stays counted.
    """
    d, hd, h = args.dim, args.ffn_hidden_dim, args.head_dim
    attn = d * args.n_heads * h * 2 + d * args.kv_heads * h * 2
    per_layer = attn + 3 * d * hd + 2 * d
    total = args.vocab_size * d + args.n_layers * per_layer + d + d * args.vocab_size
    return total - args.vocab_size * d if exclude_embedding else total


def flops_per_token(args: LlamaArgs, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token, the common MFU convention.

    6 * N for the dense matmuls (N = params without the token embedding: 2 FLOPs per
    multiply-add forward, 4 backward), plus attention scores and weighted sum:
    2 matmuls * 2 FLOPs * n_heads * head_dim * seq_len per layer forward, times 3 for
    fwd+bwd = 12 * n_layers * n_heads * head_dim * seq_len. The causal mask is ignored
    (attention counted over the full sequence), and norms/rope/softmax are not counted.
    """
    n = num_params(args, exclude_embedding=True)
    return float(6 * n + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len)


def model_flops_per_token(model: Llama3, seq_len: int) -> float:
    """flops_per_token for a built model (uses its full args, not a pipeline stage's share)."""
    return flops_per_token(model.args, seq_len)
