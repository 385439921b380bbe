"""Qwen3.5-MoE family (text model): model.py, hf.py; the layout rules are the dense
family's (``qwen3_5/family.py``) with expert parallelism added; flavors in
conf/model/qwen3_5_moe_debug.yaml and the published sizes."""

from __future__ import annotations

from titan_hydra.models.qwen3_5.family import HybridFamily
from titan_hydra.models.qwen3_5_moe.hf import Qwen35MoeHFAdapter
from titan_hydra.models.qwen3_5_moe.model import Qwen35Moe, Qwen35MoeArgs


FAMILY = HybridFamily.of("qwen3_5_moe", Qwen35MoeArgs, Qwen35Moe, Qwen35MoeHFAdapter())

__all__ = ["FAMILY", "Qwen35Moe", "Qwen35MoeArgs"]
