"""GPT-OSS decoder (openai/gpt-oss-20b, gpt-oss-120b), parallelism-agnostic.

What differs from the other decoder families, each mirroring transformers' ``GptOssForCausalLM``:

* attention: biases on q/k/v/o, a learned sink logit per head (``common/attention.py``), and
  layers alternating between a sliding window (``sliding_window`` keys) and full causal
  attention (HF ``layer_types``; default: even layers sliding, odd layers full);
* rotary: HF's half-split pairing with YaRN frequencies and its cos/sin magnitude multiplier;
  GPT-OSS's YaRN does not round the ramp bounds (``truncate: false``);
* experts (``GptOssExperts``): biases on every projection and a clamped SwiGLU,
  ``(clamp(up, -L, L) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(gate, max=L)``;
* router (``GptOssRouter``): a linear gate with a bias; softmax over the top-k logits, which is
  the existing softmax-over-all-experts + top-k + renormalize (``route_norm``) computed in fp32.

The MoE layer itself is ``common.moe.MoE`` with these two parts swapped in, so load counting,
balancing, the auxiliary loss and expert parallelism (``routed_experts``) work unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titan_hydra.models.common.attention import Attention
from titan_hydra.models.common.decoder import Decoder, Multipliers, TransformerBlock, residual_out_std
from titan_hydra.models.common.moe import GroupedExperts, MoE, MoEArgs, TokenChoiceRouter
from titan_hydra.models.common.rotary import check_rotary_heads, inverse_frequencies, yarn_frequencies

ROPE_TYPES = ("default", "yarn")
LAYER_TYPES = ("sliding_attention", "full_attention")


def alternating_layer_types(n_layers: int) -> list[str]:
    """HF's default: sliding window on layers 0, 2, 4, ..., full attention on 1, 3, 5, ..."""
    return [LAYER_TYPES[i % 2] for i in range(n_layers)]


@dataclass(kw_only=True)
class GptOssArgs(Multipliers):
    """gpt-oss hyper-parameters. Shape fields have no default (each flavor's shape lives in
    conf/model/gpt_oss_*.yaml only); the rest default to gpt-oss-20b's conventions."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None  # None: n_heads (no grouping)
    head_dim: int
    vocab_size: int
    norm_eps: float = 1e-5
    max_seq_len: int
    attention_bias: bool = True
    sliding_window: int
    layer_types: list[str] | None = None  # None: alternating_layer_types(n_layers)
    rope_theta: float = 150000.0
    rope_type: str = "yarn"  # "default" | "yarn"
    rope_factor: float = 32.0
    rope_original_max_seq_len: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    rope_truncate: bool = False  # round the YaRN ramp bounds (HF rope_parameters.truncate)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    moe: MoEArgs | dict
    tie_word_embeddings: bool = False
    depth_init: bool = True

    def __post_init__(self) -> None:
        self.moe = MoEArgs.of(self.moe)
        check_rotary_heads(self.n_heads, self.n_kv_heads, self.head_dim)
        if self.sliding_window < 1:
            raise ValueError(f"model.sliding_window={self.sliding_window} must be >= 1")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"model.rope_type={self.rope_type!r} is not one of {', '.join(ROPE_TYPES)}")
        if self.layer_types is not None:
            self.layer_types = [str(t) for t in self.layer_types]
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad or len(self.layer_types) != self.n_layers:
                raise ValueError(f"model.layer_types must list {self.n_layers} entries from {', '.join(LAYER_TYPES)} "
                                 f"(got {len(self.layer_types)}{', unknown ' + str(bad) if bad else ''}); "
                                 "or leave it null for alternating sliding/full layers")
        if self.swiglu_limit <= 0:
            raise ValueError(f"model.swiglu_limit={self.swiglu_limit} must be > 0")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def layer_kinds(self) -> list[str]:
        return list(self.layer_types) if self.layer_types is not None else alternating_layer_types(self.n_layers)


def rope_frequencies(args: GptOssArgs, device=None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim/2] fp32, cos/sin multiplier)."""
    if args.rope_type == "default":
        return inverse_frequencies(args.head_dim, args.rope_theta, device).float(), 1.0
    return yarn_frequencies(args.head_dim, args.rope_theta, args.rope_factor, args.rope_original_max_seq_len,
                            args.beta_fast, args.beta_slow, device=device, truncate=args.rope_truncate)


# ------------------------------------------------------------------------------------- MoE


class GptOssRouter(TokenChoiceRouter):
    """TokenChoiceRouter whose gate has a bias (HF ``mlp.router.weight`` / ``.bias``)."""

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__(dim, args)
        self.gate = nn.Linear(dim, args.num_experts, bias=True)

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x.float(), self.gate.weight.float(), self.gate.bias.float())
        return logits.softmax(dim=-1) if self.score_func == "softmax" else logits.sigmoid()

    def init_weights(self, std: float = 0.02) -> None:
        super().init_weights(std)
        nn.init.zeros_(self.gate.bias)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's gated unit: (clamp(up, -L, L) + 1) * g * sigmoid(alpha g), g = clamp(gate, max=L)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssExperts(GroupedExperts):
    """GroupedExperts with biases (``w1_bias`` / ``w3_bias`` [E, hidden], ``w2_bias`` [E, dim]) and
    the clamped SwiGLU. Same forward contract (rows sorted by expert, ``counts``) and the same
    ``routed_experts`` marker, so expert parallel shards every [E, ...] parameter on dim 0."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool = True,
                 alpha: float = 1.702, limit: float = 7.0, bucket_rows: bool | None = None):
        super().__init__(dim, hidden_dim, num_experts, use_grouped_mm, bucket_rows)
        self.alpha, self.limit = float(alpha), float(limit)
        self.w1_bias = nn.Parameter(torch.empty(num_experts, hidden_dim))
        self.w3_bias = nn.Parameter(torch.empty(num_experts, hidden_dim))
        self.w2_bias = nn.Parameter(torch.empty(num_experts, dim))

    def run(self, x: torch.Tensor, counts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        params = (self.w1, self.w3, self.w2, self.w1_bias, self.w3_bias, self.w2_bias)
        w1, w3, w2, b1, b3, b2 = self.weights_in(dtype, *params)
        if self.grouped(x.device, dtype):
            offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
            expert_of_row = torch.repeat_interleave(torch.arange(counts.shape[0], device=x.device), counts,
                                                    output_size=x.shape[0])
            gate = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs) + b1[expert_of_row]
            up = torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs) + b3[expert_of_row]
            h = clamped_swiglu(gate, up, self.alpha, self.limit)
            return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs) + b2[expert_of_row]
        outs = []
        for e, rows in enumerate(torch.split(x, counts.tolist())):
            h = clamped_swiglu(rows @ w1[e].T + b1[e], rows @ w3[e].T + b3[e], self.alpha, self.limit)
            outs.append(h @ w2[e].T + b2[e])
        return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])

    def init_weights(self, out_std: float, in_std: float = 0.02) -> None:
        super().init_weights(out_std, in_std)
        for b in (self.w1_bias, self.w3_bias, self.w2_bias):
            nn.init.zeros_(b)


class GptOssMoE(MoE):
    """``common.moe.MoE`` with GPT-OSS's router (gate bias) and experts (biases, clamped SwiGLU)."""

    def __init__(self, dim: int, args: MoEArgs, swiglu_alpha: float, swiglu_limit: float):
        super().__init__(dim, args)
        self.router = GptOssRouter(dim, self.args)
        self.experts = GptOssExperts(dim, self.args.expert_dim, self.args.num_experts, self.args.use_grouped_mm,
                                     alpha=swiglu_alpha, limit=swiglu_limit, bucket_rows=self.args.bucket_rows)


# ------------------------------------------------------------------------------------ model


class GptOss(Decoder):
    """``GptOss(dim=2880, n_layers=24, moe={...}, ...)``: fields of ``GptOssArgs``
    (conf/model/gpt_oss_debug.yaml, gpt_oss_20b.yaml, gpt_oss_120b.yaml)."""

    scaled_rope = rope_frequencies  # YaRN: the args' frequencies and table magnitude

    def __init__(self, **fields):
        super().__init__(GptOssArgs(**fields))

    def make_block(self, layer_id: int) -> TransformerBlock:
        a = self.args
        window = a.sliding_window if a.layer_kinds[layer_id] == "sliding_attention" else None
        attention = Attention(a.dim, a.n_heads, a.kv_heads, a.head_dim, norm_eps=a.norm_eps, rope_interleaved=False,
                              bias=a.attention_bias, out_bias=a.attention_bias, sliding_window=window, sinks=True)
        ffn = GptOssMoE(a.dim, a.moe, a.swiglu_alpha, a.swiglu_limit)
        return TransformerBlock(layer_id, attention, ffn, a.dim, a.norm_eps,
                                residual_out_std(layer_id, a.n_layers, a.depth_init))


__all__ = ["GptOss", "GptOssArgs", "GptOssExperts", "GptOssMoE", "GptOssRouter", "clamped_swiglu",
           "alternating_layer_types"]
