"""Config schema of ``model=llama4_debug`` / ``llama4_scout`` / ``llama4_maverick``: types and
conventions (iRoPE, chunked attention, temperature tuning, rotary scaling), no shapes (those live
in the yaml); the nested ``moe`` node is ``MoEConfig``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from omegaconf import MISSING

from titan_hydra.models.common.moe_config import MoEConfig


@dataclass
class Llama4Config:
    _target_: str = "titan_hydra.models.llama4.Llama4"
    family: str = "llama4"
    flavor: str = "custom"
    dim: int = MISSING
    n_layers: int = MISSING
    n_heads: int = MISSING
    n_kv_heads: Optional[int] = None
    head_dim: int = MISSING
    vocab_size: int = MISSING
    ffn_hidden_dim: int = MISSING  # dense layers (HF intermediate_size_mlp)
    norm_eps: float = 1e-5
    max_seq_len: int = MISSING
    rope_theta: float = 500000.0
    rope_scaling: str = "llama3"  # none | llama3
    rope_factor: float = 16.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 1.0
    rope_original_max_seq_len: int = 8192
    nope_interval: int = 4  # layers 3, 7, 11, ... have no rotary and see the full context
    nope_layers: Optional[List[int]] = None  # explicit NoPE layer ids instead
    attention_chunk_size: Optional[int] = 8192  # rotary layers attend within chunks; null: full causal
    use_qk_norm: bool = True
    attn_temperature_tuning: bool = True
    floor_scale: float = 8192.0
    attn_scale: float = 0.1
    moe_interleave_step: int = 1  # 1: every layer MoE (Scout); 2: every other (Maverick)
    moe_layers: Optional[List[int]] = None  # explicit MoE layer ids instead
    tie_word_embeddings: bool = False
    depth_init: bool = True
    moe: MoEConfig = field(default_factory=MoEConfig)
