"""Our Llama <-> Hugging Face ``LlamaForCausalLM``: names, rotary layout, config.json.

Two differences besides names matter:

* Rotary layout. Our Llama attention (like Meta's reference) rotates interleaved pairs of the
  head dimension (2i, 2i+1); HF's ``rotate_half`` rotates pairs (i, i + head_dim/2). Attention
  scores are invariant to permuting q and k's head dimension the same way, so converting is a
  fixed row permutation of ``wq`` and ``wk`` within each head; ``wv``/``wo`` are untouched.
* The FFN width. HF stores ``intermediate_size``; we derive it from ``multiple_of`` and
  ``ffn_dim_multiplier`` (Meta's rule), so importing picks values that reproduce it exactly.

Tied models (Llama 3.2 1B/3B) write no ``lm_head.weight``, as HF does.
"""

from __future__ import annotations

from typing import Any

import torch

from titan_hydra.models.common.hf_decoder import (
    DecoderHFAdapter, HFConversionError, check_model_type, decoder_hf_config, rope_of,
)
from titan_hydra.models.common.rotary import LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_LOW_FREQ_FACTOR, LLAMA3_ORIGINAL_CONTEXT
from titan_hydra.models.llama3.model import LlamaArgs


def to_hf_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Interleaved (Meta) -> half-split (HF) rows of a q/k projection [n_heads*hd, dim]."""
    out_dim, in_dim = w.shape
    hd = out_dim // n_heads
    return w.view(n_heads, hd // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim).contiguous()


def from_hf_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Half-split (HF) -> interleaved (Meta) rows; the inverse of ``to_hf_rows``."""
    out_dim, in_dim = w.shape
    hd = out_dim // n_heads
    return w.view(n_heads, 2, hd // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim).contiguous()


_HEADS = {"attention.wq.weight": "n_heads", "attention.wk.weight": "kv_heads"}  # rows permuted per head


def _ffn_fields(dim: int, intermediate: int) -> dict[str, Any]:
    """multiple_of / ffn_dim_multiplier that make Meta's FFN rule give ``intermediate``."""
    base = int(2 * (4 * dim) / 3)
    if base <= intermediate:
        return {"multiple_of": intermediate, "ffn_dim_multiplier": None}
    return {"multiple_of": 1, "ffn_dim_multiplier": (intermediate + 0.5) / base}


class LlamaHFAdapter(DecoderHFAdapter):
    model_type = "llama"

    def to_hf_tensor(self, suffix: str, t: torch.Tensor, args: LlamaArgs) -> torch.Tensor:
        return to_hf_rows(t, getattr(args, _HEADS[suffix])) if suffix in _HEADS else t.contiguous()

    def from_hf_tensor(self, suffix: str, t: torch.Tensor, args: LlamaArgs) -> torch.Tensor:
        return from_hf_rows(t, getattr(args, _HEADS[suffix])) if suffix in _HEADS else t

    def hf_config(self, args: LlamaArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(args.rope_theta)}
        if args.rope_scaling:
            rope.update(rope_type="llama3", factor=float(args.rope_scaling_factor),
                        low_freq_factor=LLAMA3_LOW_FREQ_FACTOR, high_freq_factor=LLAMA3_HIGH_FREQ_FACTOR,
                        original_max_position_embeddings=LLAMA3_ORIGINAL_CONTEXT)
        return {**decoder_hf_config(args, architecture="LlamaForCausalLM", model_type="llama",
                                    ffn_dim=args.ffn_hidden_dim, head_dim=args.head_dim, rope=rope, dtype=dtype),
                "mlp_bias": False}

    def args_from_hf_config(self, cfg: dict[str, Any]) -> LlamaArgs:
        check_model_type(cfg, "llama")
        dim, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        if int(cfg.get("head_dim") or dim // heads) != dim // heads:
            raise HFConversionError(f"config.json head_dim={cfg['head_dim']} != hidden_size/num_attention_heads")
        theta, scaling, rope_type = rope_of(cfg, ("default", "llama3"))
        if rope_type == "llama3":
            expected = (LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_ORIGINAL_CONTEXT)
            got = (scaling.get("low_freq_factor"), scaling.get("high_freq_factor"),
                   scaling.get("original_max_position_embeddings"))
            if tuple(float(x) for x in got) != tuple(float(x) for x in expected):
                raise HFConversionError(f"llama3 rope scaling {got} differs from the supported {expected}")
        args = LlamaArgs(
            dim=dim,
            n_layers=int(cfg["num_hidden_layers"]),
            n_heads=heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            vocab_size=int(cfg["vocab_size"]),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=theta,
            rope_scaling=rope_type == "llama3",
            rope_scaling_factor=float(scaling.get("factor", 8.0)),
            max_seq_len=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            **_ffn_fields(dim, int(cfg["intermediate_size"])),
        )
        if args.ffn_hidden_dim != int(cfg["intermediate_size"]):
            raise HFConversionError(f"cannot represent intermediate_size={cfg['intermediate_size']}")
        return args
