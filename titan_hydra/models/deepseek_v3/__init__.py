"""DeepSeek-V3 family (MLA + DeepSeekMoE): model.py, hf.py, the layout rules in family.py; flavors
in conf/model/deepseek_v3_*.yaml."""

from __future__ import annotations

from titan_hydra.models.deepseek_v3.family import DeepSeekV3Family
from titan_hydra.models.deepseek_v3.model import DeepSeekV3, DeepSeekV3Args

FAMILY = DeepSeekV3Family()

__all__ = ["FAMILY", "DeepSeekV3", "DeepSeekV3Args", "DeepSeekV3Family"]
