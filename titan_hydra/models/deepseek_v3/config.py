"""Config schema of ``model=deepseek_v3_*`` options: types and conventions, no shapes (those live in the yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from titan_hydra.models.common.moe_config import MoEConfig


@dataclass
class DeepSeekV3Config:
    _target_: str = "titan_hydra.models.deepseek_v3.DeepSeekV3"
    family: str = "deepseek_v3"
    flavor: str = "custom"
    dim: int = MISSING
    n_layers: int = MISSING
    n_heads: int = MISSING
    vocab_size: int = MISSING
    norm_eps: float = 1e-6
    max_seq_len: int = MISSING
    q_lora_rank: int = MISSING  # 0: one query projection (V2-Lite); else wq_a -> q_norm -> wq_b
    kv_lora_rank: int = MISSING
    qk_nope_head_dim: int = MISSING
    qk_rope_head_dim: int = MISSING
    v_head_dim: int = MISSING
    n_dense_layers: int = MISSING  # HF first_k_dense_replace
    ffn_hidden_dim: int = MISSING  # width of the dense layers' SwiGLU (HF intermediate_size)
    moe: MoEConfig = field(default_factory=MoEConfig)
    rope_theta: float = 10000.0
    rope_interleaved: bool = True  # HF rope_interleave (DeepSeek's weights: interleaved pairs)
    rope_type: str = "yarn"  # default | yarn
    rope_factor: float = 40.0  # YaRN: context extension factor
    rope_original_max_seq_len: int = 4096  # YaRN: HF original_max_position_embeddings
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0
    tie_word_embeddings: bool = False
    depth_init: bool = True
