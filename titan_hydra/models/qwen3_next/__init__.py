"""Qwen3-Next family: the Qwen3.5-MoE model (``models/qwen3_5_moe``) read from and written to
Qwen3-Next checkpoints (``hf.py``: fused, key-head-grouped DeltaNet projections); flavor
conf/model/qwen3_next_80b_a3b.yaml."""

from __future__ import annotations

from titan_hydra.models.qwen3_5_moe import Qwen35MoeFamily
from titan_hydra.models.qwen3_next.hf import Qwen3NextHFAdapter


class Qwen3NextFamily(Qwen35MoeFamily):
    name = "qwen3_next"
    hf = Qwen3NextHFAdapter()


FAMILY = Qwen3NextFamily()

__all__ = ["FAMILY"]
