"""DeepSeek-V2/V3 decoder (MLA + DeepSeekMoE), parallelism-agnostic.

What differs from the dense families: multi-head latent attention (``common/mla.py``) with
rotary on a narrow slice of each head, YaRN-extended rotary (``common/rotary.yarn_frequencies``)
whose magnitude correction also enters the softmax scale, and a Mixture-of-Experts FFN
(``common/moe.py``: sigmoid or softmax scores, group-limited routing, shared experts, an
aux-loss-free expert bias) in every layer but the first ``n_dense_layers``, which keep a
dense SwiGLU of width ``ffn_hidden_dim``. ``mtp_layers`` > 0 adds multi-token prediction
depths (``common/mtp.py``), each an MoE layer like the released MTP layer.

The rotary pairing is a field: DeepSeek's released weights rotate interleaved pairs (HF's
``rope_interleave: true``), which is also the pairing used here by default, so conversion
permutes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_hydra.models.common.decoder import Multipliers, TransformerBlock, residual_out_std
from titan_hydra.models.common.layers import FeedForward
from titan_hydra.models.common.mla import MultiHeadLatentAttention
from titan_hydra.models.common.moe import MoE, MoEArgs
from titan_hydra.models.common.mtp import MultiTokenDecoder
from titan_hydra.models.common.rotary import inverse_frequencies, yarn_frequencies, yarn_mscale

ROPE_TYPES = ("default", "yarn")


@dataclass(kw_only=True)
class DeepSeekV3Args(Multipliers):
    """DeepSeek-V2/V3 hyper-parameters. Shape fields have no default: each flavor's shape lives in
    conf/model/deepseek_v3_*.yaml only."""

    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int
    norm_eps: float = 1e-6
    max_seq_len: int
    # multi-head latent attention
    q_lora_rank: int  # 0: queries from one dim x heads projection (V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # feed-forward: dense SwiGLU in the first n_dense_layers, MoE after
    n_dense_layers: int
    ffn_hidden_dim: int
    moe: MoEArgs | dict
    # rotary: theta, pairing, YaRN (HF rope_parameters: factor, original_max_position_embeddings, ...)
    rope_theta: float = 10000.0
    rope_interleaved: bool = True
    rope_type: str = "yarn"  # "default" | "yarn"
    rope_factor: float = 40.0
    rope_original_max_seq_len: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0
    tie_word_embeddings: bool = False
    depth_init: bool = True
    # multi-token prediction (HF num_nextn_predict_layers; the V3 release has 1); 0 = off
    mtp_layers: int = 0
    mtp_loss_weight: float = 0.3  # the report's lambda (0.3, then 0.1 for the last 4.8T tokens)

    def __post_init__(self) -> None:
        self.moe = MoEArgs.of(self.moe)
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"model.rope_type={self.rope_type!r} is not one of {', '.join(ROPE_TYPES)}")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim <= 0:
            raise ValueError(f"model.qk_rope_head_dim={self.qk_rope_head_dim} must be even and positive for rotary")
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ValueError(f"model.n_dense_layers={self.n_dense_layers} must lie in 0..n_layers={self.n_layers}")
        if self.q_lora_rank < 0 or self.kv_lora_rank <= 0:
            raise ValueError(f"model.q_lora_rank={self.q_lora_rank} must be >= 0 and model.kv_lora_rank="
                             f"{self.kv_lora_rank} > 0")
        if self.mtp_layers < 0 or self.mtp_loss_weight < 0:
            raise ValueError(f"model.mtp_layers={self.mtp_layers} and model.mtp_loss_weight={self.mtp_loss_weight} "
                             "must be >= 0")

    @property
    def head_dim(self) -> int:
        """Query/key width of one head (nope + rope part)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_heads(self) -> int:
        """Every head has its own (decompressed) key and value: no grouping."""
        return self.n_heads

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk head dim), times YaRN's mscale(factor, mscale_all_dim)^2 when YaRN is on (as HF)."""
        scale = self.head_dim**-0.5
        if self.rope_type == "yarn" and self.mscale_all_dim:
            m = yarn_mscale(self.rope_factor, self.mscale_all_dim)
            scale = scale * m * m
        return scale


def rope_frequencies(args: DeepSeekV3Args, device=None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [qk_rope_head_dim/2] fp32, cos/sin multiplier)."""
    if args.rope_type == "yarn":
        return yarn_frequencies(args.qk_rope_head_dim, args.rope_theta, args.rope_factor,
                                args.rope_original_max_seq_len, args.beta_fast, args.beta_slow, args.mscale,
                                args.mscale_all_dim, device)
    return inverse_frequencies(args.qk_rope_head_dim, args.rope_theta, device).float(), 1.0


class DeepSeekV3(MultiTokenDecoder):
    """``DeepSeekV3(dim=..., moe={...}, ...)``: fields of ``DeepSeekV3Args`` (conf/model/deepseek_v3_*.yaml)."""

    scaled_rope = rope_frequencies  # YaRN: the args' frequencies and table magnitude

    def __init__(self, **fields):
        super().__init__(DeepSeekV3Args(**fields))

    def make_block(self, layer_id: int) -> TransformerBlock:
        a = self.args
        attention = MultiHeadLatentAttention(
            a.dim, a.n_heads, q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank,
            qk_nope_head_dim=a.qk_nope_head_dim, qk_rope_head_dim=a.qk_rope_head_dim, v_head_dim=a.v_head_dim,
            softmax_scale=a.softmax_scale, rope_interleaved=a.rope_interleaved)
        if layer_id < a.n_dense_layers:
            ffn = FeedForward(a.dim, a.ffn_hidden_dim)
        else:
            ffn = MoE(a.dim, a.moe)
        return TransformerBlock(layer_id, attention, ffn, a.dim, a.norm_eps,
                                residual_out_std(layer_id, a.n_layers, a.depth_init))

