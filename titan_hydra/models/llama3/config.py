"""Config schema of ``model=llama*`` options: types and conventions, no shapes.

Shape fields are MISSING here on purpose: each flavor's shape lives in its conf/model/*.yaml only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from omegaconf import MISSING


@dataclass
class Llama3Config:
    _target_: str = "titan_hydra.models.llama3.Llama3"
    family: str = "llama3"
    flavor: str = "custom"
    dim: int = MISSING
    n_layers: int = MISSING
    n_heads: int = MISSING
    n_kv_heads: Optional[int] = None
    vocab_size: int = MISSING
    multiple_of: int = 256
    ffn_dim_multiplier: Optional[float] = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    max_seq_len: int = MISSING
    depth_init: bool = True
    tie_word_embeddings: bool = False
