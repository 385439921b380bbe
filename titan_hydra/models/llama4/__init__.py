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

from titan_hydra.errors import ConfigError
from titan_hydra.models.common.decoder_family import DecoderFamily
from titan_hydra.models.llama4.hf import Llama4HFAdapter
from titan_hydra.models.llama4.model import Llama4, Llama4Args

# fields beyond the shapes that change what saved weights compute
_SEMANTIC = ("rope_theta", "rope_scaling", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
             "rope_original_max_seq_len", "attention_chunk_size", "use_qk_norm", "attn_temperature_tuning",
             "floor_scale", "attn_scale")


class Llama4Family(DecoderFamily):
    name = "llama4"
    args_cls = Llama4Args
    model_cls = Llama4
    hf = Llama4HFAdapter()

    def check(self, args: Llama4Args, dims: Any, seq_len: int) -> None:
        if getattr(dims, "cp", 1) > 1:
            raise ConfigError(f"parallelism.cp={dims.cp} is not supported for Llama 4 (context parallel attention "
                              "has no chunked mask and NoPE temperature tuning needs positions); use parallelism.cp=1")
        super().check(args, dims, seq_len)

    def ffn_dim(self, args: Llama4Args) -> int:
        moe = args.moe
        active = int(moe.top_k * moe.expert_dim + moe.num_shared_experts * moe.expert_dim)
        return max(active, int(args.ffn_hidden_dim)) if args.dense_layer_ids else active

    def signature(self, args: Llama4Args) -> dict[str, Any]:
        sig = super().signature(args)
        sig.update({k: getattr(args, k) for k in _SEMANTIC})
        sig.update(nope_layers=args.nope_layer_ids, moe_layers=args.moe_layer_ids,
                   dense_ffn_hidden_dim=int(args.ffn_hidden_dim) if args.dense_layer_ids else 0)
        return sig

    def flops_per_token(self, args: Llama4Args, seq_len: int) -> float:
        """As DecoderFamily, but a chunked (rotary) layer attends to at most ``attention_chunk_size`` keys."""
        s = self.shape(args)
        matmul = s.active_params - (0 if s.tied_embeddings else s.embedding_params)
        chunk = args.attention_chunk_size or seq_len
        nope = set(args.nope_layer_ids)
        keys = sum(seq_len if i in nope else min(seq_len, chunk) for i in range(args.n_layers))
        return float(6 * matmul + 12 * s.n_heads * s.head_dim * keys)


FAMILY = Llama4Family()

__all__ = ["FAMILY", "Llama4", "Llama4Args"]
