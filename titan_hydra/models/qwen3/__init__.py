"""Qwen3 dense family: model.py, hf.py; flavors in conf/model/qwen3_*.yaml."""

from __future__ import annotations

from titan_hydra.models.common.decoder_family import DecoderFamily
from titan_hydra.models.qwen3.hf import Qwen3HFAdapter
from titan_hydra.models.qwen3.model import Qwen3, Qwen3Args


FAMILY = DecoderFamily.of("qwen3", Qwen3Args, Qwen3, Qwen3HFAdapter())

__all__ = ["FAMILY", "Qwen3", "Qwen3Args"]
