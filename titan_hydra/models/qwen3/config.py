"""Config schema of ``model=qwen3_*`` options: types and conventions, no shapes (those live in the yaml)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from omegaconf import MISSING


@dataclass
class Qwen3Config:
    _target_: str = "titan_hydra.models.qwen3.Qwen3"
    family: str = "qwen3"
    flavor: str = "custom"
    dim: int = MISSING
    n_layers: int = MISSING
    n_heads: int = MISSING
    n_kv_heads: Optional[int] = None
    head_dim: int = MISSING
    ffn_hidden_dim: int = MISSING
    vocab_size: int = MISSING
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_seq_len: int = MISSING
    qk_norm: bool = True
    tie_word_embeddings: bool = False
    depth_init: bool = True
