"""``Llama4Family``: what the engine asks of Llama 4, on ``DecoderFamily``: the active FFN width
(routed + shared experts, dense layers), the NoPE and MoE layers in its signature, chunked layers'
attended keys, and context parallel refused (the layouts each attention runs under: the package
docstring).
"""

from __future__ import annotations

from typing import Any

from titan_hydra.models.common import counting
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
        nope = set(args.nope_layer_ids)
        return counting.bounded_keys((None if i in nope else args.attention_chunk_size for i in range(args.n_layers)),
                                     seq_len)
