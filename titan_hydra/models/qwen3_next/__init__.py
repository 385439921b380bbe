"""Qwen3-Next family: the Qwen3.5-MoE model (``models/qwen3_5_moe``) read from and written to
Qwen3-Next checkpoints (``hf.py``: fused, key-head-grouped DeltaNet projections); flavor
conf/model/qwen3_next_80b_a3b.yaml."""

from __future__ import annotations

from titan_hydra.models.qwen3_5.family import HybridFamily
from titan_hydra.models.qwen3_5_moe.model import Qwen35Moe, Qwen35MoeArgs
from titan_hydra.models.qwen3_next.hf import Qwen3NextHFAdapter

FAMILY = HybridFamily.of("qwen3_next", Qwen35MoeArgs, Qwen35Moe, Qwen3NextHFAdapter())

__all__ = ["FAMILY"]
