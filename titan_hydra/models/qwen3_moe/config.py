"""Config schema of ``model=qwen3_moe_debug`` / ``qwen3_30b_a3b`` / ``qwen3_235b_a22b``: types and
conventions, no shapes (those live in the yaml); the nested ``moe`` node is ``MoEConfig``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import MISSING

from titan_hydra.models.common.moe_config import MoEConfig


@dataclass
class Qwen3MoeConfig:
    _target_: str = "titan_hydra.models.qwen3_moe.Qwen3Moe"
    family: str = "qwen3_moe"
    flavor: str = "custom"
    dim: int = MISSING
    n_layers: int = MISSING
    n_heads: int = MISSING
    n_kv_heads: Optional[int] = None
    head_dim: int = MISSING
    ffn_hidden_dim: int = MISSING  # width of the dense layers (HF intermediate_size)
    n_dense_layers: int = 0
    vocab_size: int = MISSING
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_seq_len: int = MISSING
    qk_norm: bool = True
    tie_word_embeddings: bool = False
    depth_init: bool = True
    moe: MoEConfig = field(default_factory=MoEConfig)
