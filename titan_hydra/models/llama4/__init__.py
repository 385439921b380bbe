"""Llama 4 family (text decoder): model.py, hf.py, family.py; flavors in conf/model/llama4_debug.yaml,
llama4_scout.yaml, llama4_maverick.yaml.

Which layouts run which attention (full causal in NoPE layers, chunked in rotary layers):

* one process, fsdp / hsdp / ddp, pp, ep, activation checkpointing, checkpoints: both (the
  masks live inside the attention module; fsdp(2), ep(2) and pp(2) losses equal one process in
  fp32, tests/test_llama4.py);
* tp: refused with one line (MoE layers have no TP plan);
* cp: refused with one line: context parallel's ring attention implements only the plain
  causal mask, not chunks, and the NoPE layers' temperature tuning needs each query's position.
"""

from __future__ import annotations

from titan_hydra.models.llama4.family import Llama4Family
from titan_hydra.models.llama4.model import Llama4, Llama4Args

FAMILY = Llama4Family()

__all__ = ["FAMILY", "Llama4", "Llama4Args", "Llama4Family"]
