"""``DeepSeekV3Family``: what the engine asks of DeepSeek-V3 (MLA + DeepSeekMoE), on ``DecoderFamily``.

What the family answers differently from the dense decoders:

* FLOPs: attention scores use the query/key head width (nope + rope) and the weighted sum the
  value width, so the attention term is 6 x layers x heads x (qk + v head dim) x seq; each
  multi-token prediction depth adds a layer and a pass through the output head.
* Tensor parallel is refused with one line: the Megatron plan addresses wq/wk/wv, MLA has a
  latent path whose rope key is shared by all heads, and the MoE layers have no TP plan yet.
  Data, pipeline, context and expert parallelism need no model knowledge.
* ``signature`` lists every field that changes what the weights mean (MLA widths, routing as
  ``moe.<key>``, so a mismatch names the one key).
"""

from __future__ import annotations

from typing import Any

from titan_hydra.errors import ConfigError
from titan_hydra.models.common.decoder_family import DecoderFamily
from titan_hydra.models.deepseek_v3.hf import DeepSeekV3HFAdapter
from titan_hydra.models.deepseek_v3.model import DeepSeekV3, DeepSeekV3Args

# Fields that do not change what saved weights mean (lengths, init, training-time balancing). The
# MTP depths add weights but change none of the main model's: a checkpoint with them loads into a
# run without (fine-tuning DeepSeek-V3 without MTP), and one without them fails by its missing names.
NON_SEMANTIC = ("max_seq_len", "depth_init", "mtp_layers", "mtp_loss_weight")
NON_SEMANTIC_MOE = ("load_balance_coeff", "aux_loss_coeff", "use_grouped_mm", "bucket_rows")
NO_TP = ("model.family=deepseek_v3 has no tensor-parallel plan (MLA's shared rope key, MoE experts); "
         "set parallelism.tp=1 and scale with fsdp/ep/pp/cp")


class DeepSeekV3Family(DecoderFamily):
    name = "deepseek_v3"
    args_cls = DeepSeekV3Args
    model_cls = DeepSeekV3
    hf = DeepSeekV3HFAdapter()

    def flops_per_token(self, args: DeepSeekV3Args, seq_len: int) -> float:
        """Multi-token prediction adds, per depth, its layer's active weights (in ``active_params``),
        one more attention term and one more pass through the shared output head."""
        matmul = self.matmul_params(args) + args.mtp_layers * args.vocab_size * args.dim
        attention = 6 * (args.n_layers + args.mtp_layers) * args.n_heads * (args.head_dim + args.v_head_dim) * seq_len
        return float(6 * matmul + attention)

    def signature(self, args: DeepSeekV3Args) -> dict[str, Any]:
        fields = self.args_fields(args)
        sig = {"family": self.name}
        sig.update({k: v for k, v in fields.items() if k not in NON_SEMANTIC and k != "moe"})
        sig.update({f"moe.{k}": v for k, v in fields["moe"].items() if k not in NON_SEMANTIC_MOE})
        return sig

    def check(self, args: DeepSeekV3Args, dims: Any, seq_len: int) -> None:
        if dims.tp > 1:
            raise ConfigError(f"parallelism.tp={dims.tp}: {NO_TP}")
        if args.mtp_layers and getattr(dims, "cp", 1) > 1:
            raise ConfigError(f"model.mtp_layers={args.mtp_layers} with parallelism.cp={dims.cp}: each depth shifts "
                              "tokens across the context shards; set model.mtp_layers=0 or parallelism.cp=1")
        super().check(args, dims, seq_len)

    def tp_plan(self, model, sequence_parallel: bool, loss_parallel: bool) -> dict:
        raise ConfigError(NO_TP)
