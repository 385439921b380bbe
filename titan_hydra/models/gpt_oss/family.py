"""``GptOssFamily``: what the engine asks of GPT-OSS, on ``DecoderFamily``: its semantic fields,
the layer types in its signature, sliding layers' attended keys, and context parallel refused (the
layouts each attention mask runs under: the package docstring).
"""

from __future__ import annotations

from typing import Any

from titan_hydra.models.common import counting
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
        return counting.attended_keys(args.layer_kinds, args.sliding_window, seq_len)
