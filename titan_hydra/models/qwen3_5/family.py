"""``HybridFamily``: the model protocol for Qwen3.5-style hybrids (dense and MoE), on DecoderFamily.

What differs from a plain decoder:

* Layouts: one process, fsdp / hsdp / ddp, pp, ep (MoE), compile per block and activation
  checkpointing run unchanged (blocks are ``model.layers`` entries whatever their mixer).
* Tensor parallel (dense; MoE models have no expert TP plan, ``DecoderFamily.check``): full-attention
  blocks take the decoder plan; a Gated DeltaNet keeps whole heads per rank: its input gathered
  to the full sequence, ``in_proj_q/k/v/z/a/b`` column-wise (rank r: key heads r Hk/tp.. and the
  value heads that read them), ``out_proj`` row-wise, the convolutions (per channel), ``dt_bias``
  and ``A_log`` (per head) as Shard(0) DTensors, the gated norm (one weight for all heads) on the
  local heads with its gradient summed over the ranks. So tp must divide
  ``linear_num_key_heads``. Sequence and loss parallel work as for a decoder. Context parallel is
  refused in one line: the DeltaNet state would have to pass from rank to rank along the sequence.
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

from torch import nn

from titan_hydra.errors import ConfigError
from titan_hydra.models.common.decoder_family import DecoderFamily
from titan_hydra.models.protocol import ModelShape
from titan_hydra.models.qwen3_5.layer_pattern import FULL, LINEAR

# what a Gated DeltaNet reads directly rather than through a submodule's call: split by channel / head
_SHARDED_PARAMS = ("conv_q.weight", "conv_k.weight", "conv_v.weight", "dt_bias", "A_log")


class HybridFamily(DecoderFamily):
    semantic_fields = ("layer_kinds", "partial_rotary_factor", "linear_num_key_heads", "linear_num_value_heads",
                       "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim")

    def check(self, args: Any, dims: Any, seq_len: int) -> None:
        if getattr(dims, "cp", 1) > 1 and LINEAR in args.layer_kinds:
            raise ConfigError(f"parallelism.cp={dims.cp} is not supported for {self.name} with linear_attention "
                              "layers (the Gated DeltaNet state would pass between context ranks); use parallelism.cp=1")
        super().check(args, dims, seq_len)
        if LINEAR in args.layer_kinds and args.linear_num_key_heads % dims.tp:
            raise ConfigError(f"parallelism.tp={dims.tp} must divide model.linear_num_key_heads="
                              f"{args.linear_num_key_heads} (each rank keeps whole Gated DeltaNet heads); "
                              "pick a tp that divides it")

    def tp_plan(self, model: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> dict:
        """The decoder plan (full-attention blocks, FFNs, norms, embedding, head) + the Gated DeltaNets'."""
        # lazy, as in DecoderFamily.tp_plan: only TP runs import torch.distributed.tensor's styles
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        from titan_hydra.models.common.tp_styles import HeadShardedNorm, PrepareInputShardParams  # lazy: see above

        plan = super().tp_plan(model, sequence_parallel, loss_parallel)
        seq = Shard(1) if sequence_parallel else Replicate()
        for name, block in model.layers.items():
            if getattr(block, "linear_attn", None) is None:
                continue
            p = f"layers.{name}.linear_attn"
            # forward(x, document_ids=...): x gathered to the full sequence (the ids are whole already)
            plan[p] = PrepareInputShardParams(params=_SHARDED_PARAMS, input_layouts=(seq,),
                                              desired_input_layouts=(Replicate(),), use_local_output=True)
            for w in ("q", "k", "v", "z", "a", "b"):
                plan[f"{p}.in_proj_{w}"] = ColwiseParallel()
            plan[f"{p}.norm"] = HeadShardedNorm()  # input [B, S, H_local, dv], weight shared by all heads
            plan[f"{p}.out_proj"] = RowwiseParallel(output_layouts=seq)
        return plan

    def shape(self, args: Any) -> ModelShape:
        return dataclasses.replace(
            super().shape(args), linear_layers=args.layer_kinds.count(LINEAR),
            linear_k_heads=args.linear_num_key_heads, linear_v_heads=args.linear_num_value_heads,
            linear_k_head_dim=args.linear_key_head_dim, linear_v_head_dim=args.linear_value_head_dim,
            linear_chunk=args.linear_chunk_size)

    def attended_keys(self, args: Any, seq_len: int) -> int:
        """Only the full-attention layers attend (the linear ones: ``flops_per_token``)."""
        return args.layer_kinds.count(FULL) * seq_len

    def flops_per_token(self, args: Any, seq_len: int) -> float:
        """As DecoderFamily's, plus the Gated DeltaNet layers' chunked recurrence."""
        linear = args.layer_kinds.count(LINEAR)
        dk, dv = args.linear_key_head_dim, args.linear_value_head_dim
        chunk = min(args.linear_chunk_size, seq_len)
        # per value head and token: scores and outputs within the chunk, and three [dk, dv] state products
        gdn = 6 * args.linear_num_value_heads * (chunk * (dk + dv) + 3 * dk * dv)
        return super().flops_per_token(args, seq_len) + linear * gdn
