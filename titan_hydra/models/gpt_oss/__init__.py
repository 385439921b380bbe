"""GPT-OSS family: model.py, hf.py; flavors in conf/model/gpt_oss_debug.yaml,
gpt_oss_20b.yaml, gpt_oss_120b.yaml.

Which layouts support which attention mask (causal / sliding window / sinks):

* one process, fsdp / hsdp / ddp, pp, ep, activation checkpointing, checkpoints: all three
  (the mask lives inside the attention module; fsdp(2), pp(2) and ep(2) losses equal one
  process within 1e-6 in fp32, tests/test_gpt_oss.py);
* tp: refused with one line (MoE layers have no TP plan, and the per-head sinks would need
  sharding with the heads);
* cp: refused with one line: context parallel's ring attention handlers implement only the
  plain causal mask, not sliding windows or sinks;
* compile: the masked path compiles (inductor on CPU, checked by hand: forward and gradients
  equal eager within 3e-6); not part of the test suite.
"""

from __future__ import annotations

from typing import Any

from titan_hydra.models.common.decoder_family import DecoderFamily
from titan_hydra.models.gpt_oss.hf import GptOssHFAdapter
from titan_hydra.models.gpt_oss.model import GptOss, GptOssArgs


class GptOssFamily(DecoderFamily):
    name = "gpt_oss"
    args_cls = GptOssArgs
    model_cls = GptOss
    hf = GptOssHFAdapter()
    semantic_fields = ("attention_bias", "sliding_window", "rope_type", "rope_factor", "rope_original_max_seq_len",
                       "beta_fast", "beta_slow", "rope_truncate", "swiglu_alpha", "swiglu_limit")
    no_context_parallel = "GPT-OSS (context parallel attention has no sliding-window or sink masks)"

    def signature(self, args: GptOssArgs) -> dict[str, Any]:
        return {**super().signature(args), "layer_types": args.layer_kinds}

    def attended_keys(self, args: GptOssArgs, seq_len: int) -> int:
        """A sliding layer attends to at most ``sliding_window`` keys."""
        return sum(min(seq_len, args.sliding_window) if kind == "sliding_attention" else seq_len
                   for kind in args.layer_kinds)


FAMILY = GptOssFamily()

__all__ = ["FAMILY", "GptOss", "GptOssArgs"]
