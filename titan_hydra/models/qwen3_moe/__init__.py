"""Qwen3-MoE family: model.py, hf.py; flavors in conf/model/qwen3_moe_debug.yaml,
qwen3_30b_a3b.yaml, qwen3_235b_a22b.yaml."""

from __future__ import annotations

from titan_hydra.models.common.decoder_family import DecoderFamily
from titan_hydra.models.qwen3_moe.hf import Qwen3MoeHFAdapter
from titan_hydra.models.qwen3_moe.model import Qwen3Moe, Qwen3MoeArgs


FAMILY = DecoderFamily.of("qwen3_moe", Qwen3MoeArgs, Qwen3Moe, Qwen3MoeHFAdapter())

__all__ = ["FAMILY", "Qwen3Moe", "Qwen3MoeArgs"]
