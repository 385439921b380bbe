"""Qwen3.5 dense family (text model): model.py, hf.py, layer_pattern.py; the layout
rules in family.py; flavors in conf/model/qwen3_5_*.yaml (the MoE flavor is ``models/qwen3_5_moe``)."""

from __future__ import annotations

from titan_hydra.models.qwen3_5.family import HybridFamily
from titan_hydra.models.qwen3_5.hf import Qwen35HFAdapter
from titan_hydra.models.qwen3_5.model import Qwen35, Qwen35Args


FAMILY = HybridFamily.of("qwen3_5", Qwen35Args, Qwen35, Qwen35HFAdapter())

__all__ = ["FAMILY", "Qwen35", "Qwen35Args"]
