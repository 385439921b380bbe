"""Our Qwen3 <-> Hugging Face ``Qwen3ForCausalLM``.

Names follow HF's Llama-style scheme plus ``self_attn.q_norm`` / ``k_norm``. Our Qwen3 rotates
in HF's half-split pairing, so every tensor converts unchanged. Tied flavors write no
``lm_head.weight`` (HF ties it on load).
"""

from __future__ import annotations

from typing import Any

import torch

from titan_hydra.models.common.hf_decoder import (
    HFConversionError, check_model_type, decoder_hf_config, from_hf_name, rope_theta_of, to_hf_name,
)
from titan_hydra.models.protocol import HFAdapter
from titan_hydra.models.qwen3.model import Qwen3Args

class Qwen3HFAdapter(HFAdapter):
    model_type = "qwen3"

    def to_hf_state(self, sd: dict[str, torch.Tensor], args: Qwen3Args) -> dict[str, torch.Tensor]:
        return {to_hf_name(k): t.contiguous() for k, t in sd.items()
                if not (k == "output.weight" and args.tie_word_embeddings)}

    def from_hf_state(self, sd: dict[str, torch.Tensor], args: Qwen3Args) -> dict[str, torch.Tensor]:
        out = {from_hf_name(k): t for k, t in sd.items()
               if not (k == "lm_head.weight" and args.tie_word_embeddings) and not k.endswith("rotary_emb.inv_freq")}
        if args.tie_word_embeddings and "tok_embeddings.weight" in out:
            out["output.weight"] = out["tok_embeddings.weight"]
        return out

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
        theta, scaling = rope_theta_of(cfg)
        rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type != "default":
            raise HFConversionError(f"rope type {rope_type!r} is not supported for Qwen3 (default only)")
        heads = int(cfg["num_attention_heads"])
        return Qwen3Args(
            dim=int(cfg["hidden_size"]),
            n_layers=int(cfg["num_hidden_layers"]),
            n_heads=heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            ffn_hidden_dim=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_seq_len=int(cfg.get("max_position_embeddings", 40960)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )
