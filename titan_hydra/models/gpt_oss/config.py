"""Config schema of ``model=gpt_oss_debug`` / ``gpt_oss_20b`` / ``gpt_oss_120b``: types and
conventions (GPT-OSS's rotary, window, SwiGLU clamp), no shapes (those live in the yaml); the
nested ``moe`` node is ``MoEConfig``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from omegaconf import MISSING

from titan_hydra.models.common.moe_config import MoEConfig


@dataclass
class GptOssConfig:
    _target_: str = "titan_hydra.models.gpt_oss.GptOss"
    family: str = "gpt_oss"
    flavor: str = "custom"
    dim: int = MISSING
    n_layers: int = MISSING
    n_heads: int = MISSING
    n_kv_heads: Optional[int] = None
    head_dim: int = MISSING
    vocab_size: int = MISSING
    norm_eps: float = 1e-5
    max_seq_len: int = MISSING
    attention_bias: bool = True
    sliding_window: int = MISSING
    layer_types: Optional[List[str]] = None  # null: sliding, full, sliding, full, ...
    rope_theta: float = 150000.0
    rope_type: str = "yarn"
    rope_factor: float = 32.0
    rope_original_max_seq_len: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    rope_truncate: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    tie_word_embeddings: bool = False
    depth_init: bool = True
    moe: MoEConfig = field(default_factory=MoEConfig)
