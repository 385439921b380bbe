"""Llama 2 / 3 family: the model (model.py) and its HF adapter (hf.py); its Hydra schema
(``schema_model_llama3``) is derived from ``LlamaArgs`` and ``Llama3`` (titan_hydra.groups).

``FAMILY`` is what ``model.family: llama3`` resolves to. Flavors (published shapes) live in
``conf/model/llama*.yaml`` and nowhere else.
"""

from __future__ import annotations

from titan_hydra.models.common.decoder_family import DecoderFamily
from titan_hydra.models.llama3.hf import LlamaHFAdapter
from titan_hydra.models.llama3.model import Llama3, LlamaArgs


FAMILY = DecoderFamily.of("llama3", LlamaArgs, Llama3, LlamaHFAdapter())

__all__ = ["FAMILY", "Llama3", "LlamaArgs"]
