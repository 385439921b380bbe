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

from titan_hydra.errors import ConfigError
from titan_hydra.models.common.decoder_family import DecoderFamily
from titan_hydra.models.gpt_oss.hf import GptOssHFAdapter
from titan_hydra.models.gpt_oss.model import GptOss, GptOssArgs

# fields beyond the shapes that change what saved weights compute
_SEMANTIC = ("attention_bias", "sliding_window", "rope_type", "rope_factor", "rope_original_max_seq_len",
             "beta_fast", "beta_slow", "rope_truncate", "swiglu_alpha", "swiglu_limit")


class GptOssFamily(DecoderFamily):
    name = "gpt_oss"
    args_cls = GptOssArgs
    model_cls = GptOss
    hf = GptOssHFAdapter()

    def check(self, args: GptOssArgs, dims: Any, seq_len: int) -> None:
        if getattr(dims, "cp", 1) > 1:
            raise ConfigError(f"parallelism.cp={dims.cp} is not supported for GPT-OSS (context parallel attention "
                              "has no sliding-window or sink masks); use parallelism.cp=1")
        super().check(args, dims, seq_len)

    def signature(self, args: GptOssArgs) -> dict[str, Any]:
        sig = super().signature(args)
        sig.update({k: getattr(args, k) for k in _SEMANTIC})
        sig["layer_types"] = args.layer_kinds
        return sig

    def flops_per_token(self, args: GptOssArgs, seq_len: int) -> float:
        """As DecoderFamily, but a sliding layer attends to at most ``sliding_window`` keys."""
        s = self.shape(args)
        matmul = s.active_params - (0 if s.tied_embeddings else s.embedding_params)
        keys = sum(min(seq_len, args.sliding_window) if kind == "sliding_attention" else seq_len
                   for kind in args.layer_kinds)
        return float(6 * matmul + 12 * s.n_heads * s.head_dim * keys)


FAMILY = GptOssFamily()

__all__ = ["FAMILY", "GptOss", "GptOssArgs"]
