"""Llama 4 family (text decoder): model.py, hf.py; flavors in conf/model/llama4_debug.yaml,
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

from typing import Any

from titan_hydra.models.common.decoder_family import DecoderFamily
from titan_hydra.models.llama4.hf import Llama4HFAdapter
from titan_hydra.models.llama4.model import Llama4, Llama4Args


class Llama4Family(DecoderFamily):
    name = "llama4"
    args_cls = Llama4Args
    model_cls = Llama4
    hf = Llama4HFAdapter()
    semantic_fields = ("rope_theta", "rope_scaling", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                       "rope_original_max_seq_len", "attention_chunk_size", "use_qk_norm", "attn_temperature_tuning",
                       "floor_scale", "attn_scale")
    no_context_parallel = ("Llama 4 (context parallel attention has no chunked mask and NoPE temperature tuning "
                           "needs positions)")

    def ffn_dim(self, args: Llama4Args) -> int:
        moe = args.moe
        active = int(moe.top_k * moe.expert_dim + moe.num_shared_experts * moe.expert_dim)
        return max(active, int(args.ffn_hidden_dim)) if args.dense_layer_ids else active

    def signature(self, args: Llama4Args) -> dict[str, Any]:
        return {**super().signature(args), "nope_layers": args.nope_layer_ids, "moe_layers": args.moe_layer_ids,
                "dense_ffn_hidden_dim": int(args.ffn_hidden_dim) if args.dense_layer_ids else 0}

    def attended_keys(self, args: Llama4Args, seq_len: int) -> int:
        """A chunked (rotary) layer attends to at most ``attention_chunk_size`` keys."""
        chunk = args.attention_chunk_size or seq_len
        nope = set(args.nope_layer_ids)
        return sum(seq_len if i in nope else min(seq_len, chunk) for i in range(args.n_layers))


FAMILY = Llama4Family()

__all__ = ["FAMILY", "Llama4", "Llama4Args"]
