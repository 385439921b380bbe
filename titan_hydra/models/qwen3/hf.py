"""Our Qwen3 <-> Hugging Face ``Qwen3ForCausalLM``.

Names follow HF's Llama-style scheme plus ``self_attn.q_norm`` / ``k_norm``. Our Qwen3 rotates
in HF's half-split pairing, so every tensor converts unchanged. Tied flavors write no
``lm_head.weight`` (HF ties it on load).
"""

from __future__ import annotations

from typing import Any

import torch

from titan_hydra.models.common.hf_decoder import (
    DecoderHFAdapter, HFConversionError, check_model_type, decoder_args_of, decoder_hf_config, rope_of,
)
from titan_hydra.models.qwen3.model import Qwen3Args


class Qwen3HFAdapter(DecoderHFAdapter):
    model_type = "qwen3"

    def hf_config(self, args: Qwen3Args, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        rope = {"rope_type": "default", "rope_theta": float(args.rope_theta)}
        return {**decoder_hf_config(args, architecture="Qwen3ForCausalLM", model_type="qwen3",
                                    ffn_dim=args.ffn_hidden_dim, head_dim=args.head_dim, rope=rope, dtype=dtype),
                "use_sliding_window": False}

    def args_from_hf_config(self, cfg: dict[str, Any]) -> Qwen3Args:
        check_model_type(cfg, "qwen3")
        if cfg.get("attention_bias"):
            raise HFConversionError("config.json has attention_bias=true; Qwen3 here has no attention biases")
        if cfg.get("use_sliding_window"):
            raise HFConversionError("config.json has use_sliding_window=true; sliding-window attention is not supported")
        theta, _, _ = rope_of(cfg, ("default",), "Qwen3")
        return Qwen3Args(**decoder_args_of(cfg, norm_eps=1e-6, max_seq_len=40960),
                         ffn_hidden_dim=int(cfg["intermediate_size"]), rope_theta=theta)
