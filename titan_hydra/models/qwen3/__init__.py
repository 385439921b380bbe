"""Qwen3 dense family: model.py, hf.py; flavors in conf/model/qwen3_*.yaml."""

from __future__ import annotations

from titan_hydra.models.common.decoder_family import DecoderFamily
from titan_hydra.models.qwen3.hf import Qwen3HFAdapter
from titan_hydra.models.qwen3.model import Qwen3, Qwen3Args


class Qwen3Family(DecoderFamily):
    name = "qwen3"
    args_cls = Qwen3Args
    model_cls = Qwen3
    hf = Qwen3HFAdapter()


FAMILY = Qwen3Family()

__all__ = ["FAMILY", "Qwen3", "Qwen3Args"]
