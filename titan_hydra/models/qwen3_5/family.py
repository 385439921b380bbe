"""``HybridFamily``: the model protocol for Qwen3.5-style hybrids (dense and MoE), on DecoderFamily.

What differs from a plain decoder:

* Layouts: one process, fsdp / hsdp / ddp, pp, ep (MoE), compile per block and activation
  checkpointing run unchanged (blocks are ``model.layers`` entries whatever their mixer).
  Tensor parallel is refused in one line: a Gated DeltaNet's ``in_proj_qkv`` and convolution
  concatenate q | k | v, so a column shard would have to take each part's heads separately (HF
  gathers the outputs instead). Context parallel is refused in one line: the DeltaNet state would
  have to pass from rank to rank along the sequence.
* FLOPs: attention's quadratic term counts the full-attention layers only; a DeltaNet layer adds
  its chunked form's work per token (intra-chunk scores and outputs over ``linear_chunk_size``
  tokens, plus reading and writing the [dk, dv] state per value head), linear in the sequence.
* Shape: the DeltaNet layers' count and widths ride on ``ModelShape`` (``linear_*``), so the
  planner's activation model can count what they save.
* Signature: the layer types and the rotary share change what the weights compute.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from titan_hydra.errors import ConfigError
from titan_hydra.models.common.decoder_family import DecoderFamily
from titan_hydra.models.protocol import ModelShape
from titan_hydra.models.qwen3_5.layer_pattern import FULL, LINEAR

_SEMANTIC = ("layer_kinds", "partial_rotary_factor", "linear_num_key_heads", "linear_num_value_heads",
             "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim")


class HybridFamily(DecoderFamily):
    def check(self, args: Any, dims: Any, seq_len: int) -> None:
        if dims.tp > 1:
            raise ConfigError(f"parallelism.tp={dims.tp} is not supported for {self.name} (a Gated DeltaNet's "
                              "q|k|v projection and convolution cannot be split by one column shard); use fsdp / pp"
                              f"{' / ep' if getattr(args, 'moe', None) is not None else ''} instead")
        if getattr(dims, "cp", 1) > 1 and LINEAR in args.layer_kinds:
            raise ConfigError(f"parallelism.cp={dims.cp} is not supported for {self.name} with linear_attention "
                              "layers (the Gated DeltaNet state would pass between context ranks); use parallelism.cp=1")
        super().check(args, dims, seq_len)

    def shape(self, args: Any) -> ModelShape:
        return dataclasses.replace(
            super().shape(args), linear_layers=args.layer_kinds.count(LINEAR),
            linear_k_heads=args.linear_num_key_heads, linear_v_heads=args.linear_num_value_heads,
            linear_k_head_dim=args.linear_key_head_dim, linear_v_head_dim=args.linear_value_head_dim,
            linear_chunk=args.linear_chunk_size)

    def signature(self, args: Any) -> dict[str, Any]:
        sig = super().signature(args)
        sig.update({k: getattr(args, k) for k in _SEMANTIC})
        return sig

    def flops_per_token(self, args: Any, seq_len: int) -> float:
        s = self.shape(args)
        matmul = s.active_params - (0 if s.tied_embeddings else s.embedding_params)
        full = args.layer_kinds.count(FULL)
        linear = args.layer_kinds.count(LINEAR)
        dk, dv = args.linear_key_head_dim, args.linear_value_head_dim
        chunk = min(args.linear_chunk_size, seq_len)
        # per value head and token: scores and outputs within the chunk, and three [dk, dv] state products
        gdn = 6 * args.linear_num_value_heads * (chunk * (dk + dv) + 3 * dk * dv)
        return float(6 * matmul + 12 * full * s.n_heads * s.head_dim * seq_len + linear * gdn)
