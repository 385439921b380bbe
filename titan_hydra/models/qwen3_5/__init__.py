"""Qwen3.5 dense family (text model): model.py, hf.py, layer_pattern.py; the layout
rules in family.py; flavors in conf/model/qwen3_5_*.yaml (the MoE flavor is ``models/qwen3_5_moe``)."""

from __future__ import annotations

from titan_hydra.models.qwen3_5.family import HybridFamily
from titan_hydra.models.qwen3_5.hf import Qwen35HFAdapter
from titan_hydra.models.qwen3_5.model import Qwen35, Qwen35Args


class Qwen35Family(HybridFamily):
    name = "qwen3_5"
    args_cls = Qwen35Args
    model_cls = Qwen35
    hf = Qwen35HFAdapter()


FAMILY = Qwen35Family()

__all__ = ["FAMILY", "Qwen35", "Qwen35Args"]
