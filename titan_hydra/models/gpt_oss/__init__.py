"""GPT-OSS family: model.py, hf.py, family.py; flavors in conf/model/gpt_oss_debug.yaml,
gpt_oss_20b.yaml, gpt_oss_120b.yaml.

Which layouts support which attention mask (causal / sliding window / sinks):

* one process, fsdp / hsdp / ddp, pp, ep, activation checkpointing, checkpoints: all three
  (the mask lives inside the attention module; fsdp(2), pp(2) and ep(2) losses equal one
  process within 1e-6 in fp32, tests/test_gpt_oss.py);
* tp: refused with one line (MoE layers have no TP plan, and the per-head sinks would need
  sharding with the heads);
* cp: refused with one line: context parallel's ring attention handlers implement only the
  plain causal mask, not sliding windows or sinks;
* compile: the masked path compiles (inductor on CPU; a manual check, not part of the test
  suite: docs/bench/notes_models.md).
"""

from __future__ import annotations

from titan_hydra.models.gpt_oss.family import GptOssFamily
from titan_hydra.models.gpt_oss.model import GptOss, GptOssArgs

FAMILY = GptOssFamily()

__all__ = ["FAMILY", "GptOss", "GptOssArgs", "GptOssFamily"]
