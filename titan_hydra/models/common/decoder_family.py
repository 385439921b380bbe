"""``DecoderFamily``: the model protocol implemented once for every ``common.decoder.Decoder``.

What it decides, and why:

* Counting and FLOPs follow ``counting.py``: the model is built on the meta device and its
  parameters counted, split into embedding / blocks / head (the multi-token prediction depths
  count with the head, their experts with the others); results are cached per shape. A family
  whose layers attend over fewer keys (a window, a chunk) says so in ``attended_keys``.
* Mixture-of-Experts (args with a ``moe`` field, ``common/moe.py``): the routed experts are the
  ``expert_modules`` of the same meta build, of which a token uses top_k of num_experts; tensor
  parallel is refused for MoE models (the experts have no TP plan).
* Tensor parallel (Megatron-style): wq/wk/wv/w1/w3 column-wise, wo/w2 row-wise, so one
  all-reduce (or all-gather + reduce-scatter with sequence parallel) per sub-layer; embedding
  row-wise over the vocabulary; output column-wise with the logits left vocab-sharded for loss
  parallel; norms sequence-parallel (or replicated); Qwen3's QK-norm runs on the local heads.
  A tied embedding gets the output's sharded weight back after the plan (both are Shard(0) of
  [vocab, dim]).
* FSDP units: embeddings, each block, norm+output; a tied model keeps embedding, norm and
  output in one unit (a parameter can belong to only one unit).
* Pipeline stages: a deep copy of the meta model with other layers deleted and the embedding /
  head set to None; the multi-token prediction layers (``common/mtp.py``) stay on the last stage
  only. Tied models cannot be cut (the two ends live on different stages) and are refused with
  one line.
"""

from __future__ import annotations

import copy
import dataclasses
from functools import lru_cache
from typing import Any

from torch import nn

from titan_hydra.errors import ConfigError
from titan_hydra.models.common import counting, moe
from titan_hydra.models.common.decoder import MULTIPLIERS
from titan_hydra.models.common.mtp_loss import MultiTokenLoss
from titan_hydra.models.protocol import ModelFamily, ModelShape, ShardsRope, WeighsLosses, fsdp_units_in_order


# Fields beyond the shape that change what saved weights mean (rotary, norms).
SEMANTIC_FIELDS = ("norm_eps", "rope_theta", "rope_scaling", "rope_scaling_factor", "qk_norm")


class DecoderFamily(ModelFamily, ShardsRope, WeighsLosses):
    model_cls: type | None = None  # the Decoder subclass, built from args fields
    rope_buffers = ("rope_cos", "rope_sin")
    supports_document_mask = True  # Decoder.forward(tokens, doc_ids)
    # A family's own args fields that change what saved weights compute (``signature``).
    semantic_fields: tuple[str, ...] = ()
    # Why context parallel cannot run this family's attention, as "<family> (<reason>)"; "" = it can.
    no_context_parallel: str = ""

    @classmethod
    def of(cls, name: str, args_cls: type, model_cls: type, hf: Any) -> "DecoderFamily":
        """A family that is this class's rules with its own names and classes: most decoders
        need nothing else, so they are one line instead of a subclass each."""
        family = cls()
        family.name, family.args_cls, family.model_cls, family.hf = name, args_cls, model_cls, hf
        return family

    # --- shape --------------------------------------------------------------------------
    def build(self, args: Any) -> nn.Module:
        return self.model_cls(**self.args_fields(args))

    def args_fields(self, args: Any) -> dict[str, Any]:
        """Plain values: a nested args dataclass (``moe``) becomes a dict (markers are JSON)."""
        return {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
                for k, v in super().args_fields(args).items()}

    def ffn_dim(self, args: Any) -> int:
        """FFN width a token passes through; MoE: its top_k experts + the shared experts (the wider
        of that and the dense width when some layers are dense)."""
        moe = getattr(args, "moe", None)
        if moe is None:
            return int(args.ffn_hidden_dim)
        active = int(moe.top_k * moe.expert_dim + moe.num_shared_experts * moe.expert_dim)
        if getattr(args, "n_dense_layers", 0):
            return max(active, int(args.ffn_hidden_dim))
        return active

    def shape(self, args: Any) -> ModelShape:
        return _shape(self, counting.args_key(self, args))

    def flops_per_token(self, args: Any, seq_len: int) -> float:
        return counting.flops_per_token(self.shape(args), self.attended_keys(args, seq_len))

    def matmul_params(self, args: Any) -> int:
        """Active parameters a token multiplies by (``counting.matmul_params``)."""
        return counting.matmul_params(self.shape(args))

    def attended_keys(self, args: Any, seq_len: int) -> int:
        """Keys one query meets, summed over the attention layers (causal mask ignored): ``seq_len``
        in each layer, unless a layer's window or chunk bounds it."""
        return int(args.n_layers) * seq_len

    def signature(self, args: Any) -> dict[str, Any]:
        """Shapes (derived ones, so two spellings of one FFN width agree) and the fields that change
        what the weights mean; max_seq_len and init-only fields may differ."""
        s = self.shape(args)
        sig = {"family": self.name, "dim": s.dim, "n_layers": s.n_layers, "n_heads": s.n_heads,
               "kv_heads": s.n_kv_heads, "head_dim": s.head_dim, "vocab_size": s.vocab_size,
               "ffn_hidden_dim": s.ffn_dim, "tie_word_embeddings": s.tied_embeddings}
        sig.update({k: getattr(args, k) for k in (*SEMANTIC_FIELDS, *self.semantic_fields) if hasattr(args, k)})
        # muP / CompleteP multipliers change what the weights compute; only when set, so that
        # markers written before the fields existed (and every sp run) stay valid
        sig.update({k: getattr(args, k) for k in MULTIPLIERS if getattr(args, k, 1.0) != 1.0})
        moe = getattr(args, "moe", None)
        if moe is not None:  # expert count/width, routing function, which layers are dense
            n_dense = int(getattr(args, "n_dense_layers", 0))
            sig.update({"num_experts": moe.num_experts, "top_k": moe.top_k, "expert_dim": moe.expert_dim,
                        "num_shared_experts": moe.num_shared_experts, "score_func": moe.score_func,
                        "n_dense_layers": n_dense,
                        "dense_ffn_hidden_dim": int(getattr(args, "ffn_hidden_dim", 0)) if n_dense else 0})
            if moe.score_before_experts:  # only when set: markers written before the field stay valid
                sig["score_before_experts"] = True
        return sig

    def check(self, args: Any, dims: Any, seq_len: int) -> None:
        if self.no_context_parallel and getattr(dims, "cp", 1) > 1:
            raise ConfigError(f"parallelism.cp={dims.cp} is not supported for {self.no_context_parallel}; "
                              "use parallelism.cp=1")
        if seq_len > args.max_seq_len:
            raise ConfigError(
                f"training.seq_len={seq_len} exceeds model.max_seq_len={args.max_seq_len}; shorten the sequence"
            )
        tp = dims.tp
        if tp > 1 and getattr(args, "moe", None) is not None:
            raise ConfigError(
                f"parallelism.tp={tp} is not supported for Mixture-of-Experts models (model.moe); use "
                "parallelism.tp=1 and shard with fsdp / ep / pp / cp instead"
            )
        if args.n_heads % tp or args.kv_heads % tp:
            raise ConfigError(
                f"parallelism.tp={tp} must divide model.n_heads={args.n_heads} and n_kv_heads={args.kv_heads}"
            )
        if dims.pp > args.n_layers:
            raise ConfigError(f"parallelism.pp={dims.pp} exceeds model.n_layers={args.n_layers}: each stage needs "
                              "a layer; lower parallelism.pp")
        if dims.pp > 1 and args.tie_word_embeddings:
            raise ConfigError(
                "model.tie_word_embeddings=true cannot run under pipeline parallel (embedding and output "
                "live on different stages); set model.tie_word_embeddings=false or parallelism.pp=1"
            )

    # --- layout -------------------------------------------------------------------------
    def blocks(self, model: nn.Module) -> nn.ModuleDict:
        return model.layers

    def fsdp_units(self, model: nn.Module) -> list[tuple[Any, bool]]:
        tied = model.args.tie_word_embeddings and model.tok_embeddings is not None and model.output is not None
        emb = model.tok_embeddings
        head = [m for m in (model.norm, model.output) if m is not None]
        blocks = list(model.layers.values())
        blocks += list(getattr(model, "mtp_layers", None) or ())  # run after the head, shard like blocks
        return fsdp_units_in_order(emb, blocks, head, tied)

    def tp_plan(self, model: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> dict:
        # Lazy: torch.distributed.tensor takes about a second to import, and only TP runs need it
        # (not every import of a family: convert, generate, eval, the estimator).
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

        from titan_hydra.models.common.tp_styles import HeadShardedNorm, ReplicateParallel  # lazy: see above

        seq = Shard(1) if sequence_parallel else Replicate()

        def norm_style():
            return SequenceParallel() if sequence_parallel else ReplicateParallel()

        plan: dict = {}
        if model.tok_embeddings is not None:
            # Row-wise over the vocab: each rank looks up its rows, then reduce(-scatter) the sum.
            plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
        if model.norm is not None:
            plan["norm"] = norm_style()
        if model.output is not None:
            plan["output"] = ColwiseParallel(
                input_layouts=seq,
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,  # loss_parallel() needs the vocab-sharded DTensor
            )
        for name, block in model.layers.items():
            p = f"layers.{name}."
            if getattr(block, "attention", None) is not None:  # a block of another mixer: its family's plan
                # forward(x, cos, sin): x is gathered to the full sequence; cos/sin are replicated
                # plain tensors, so their layout is None (left untouched).
                plan[p + "attention"] = PrepareModuleInput(
                    input_layouts=(seq, None, None), desired_input_layouts=(Replicate(), None, None),
                    use_local_output=True,
                )
                for w in ("wq", "wk", "wv"):
                    plan[f"{p}attention.{w}"] = ColwiseParallel()
                plan[p + "attention.wo"] = RowwiseParallel(output_layouts=seq)
                if getattr(block.attention, "q_norm", None) is not None:
                    plan[p + "attention.q_norm"] = HeadShardedNorm()
                    plan[p + "attention.k_norm"] = HeadShardedNorm()
            plan[p + "feed_forward"] = PrepareModuleInput(
                input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=True
            )
            plan[p + "feed_forward.w1"] = ColwiseParallel()
            plan[p + "feed_forward.w3"] = ColwiseParallel()
            plan[p + "feed_forward.w2"] = RowwiseParallel(output_layouts=seq)
            plan[p + "attention_norm"] = norm_style()
            plan[p + "ffn_norm"] = norm_style()
        return plan

    def finish_tp(self, model: nn.Module) -> None:
        model.tie_weights()

    # --- training -----------------------------------------------------------------------
    def set_loss_scale(self, model_parts: list[nn.Module], scale: float) -> None:
        if any(self.expert_modules(part) for part in model_parts):
            moe.set_aux_grad_scale(model_parts, scale)

    def training_loss(self, args: Any) -> Any:
        if int(getattr(args, "mtp_layers", 0)):
            return MultiTokenLoss(args.mtp_loss_weight)
        return self.objective.loss

    def cut_stage(self, model: nn.Module, layer_ids: range, is_first: bool, is_last: bool) -> nn.Module:
        stage = copy.deepcopy(model)
        for name in list(stage.layers.keys()):
            if int(name) not in layer_ids:
                del stage.layers[name]
        if not is_first:
            stage.tok_embeddings = None
        if not is_last:
            stage.norm = None
            stage.output = None
            if getattr(stage, "mtp_layers", None) is not None:  # multi-token prediction: the last stage
                stage.mtp_layers = None
        return stage


@lru_cache(maxsize=256)
def _shape(family: DecoderFamily, key: str) -> ModelShape:
    """``key``: the args fields as sorted JSON (``counting.args_key``)."""
    args, model = counting.meta_build(family, key)
    experts = family.expert_modules(model)
    mtp = getattr(model, "mtp_layers", None) or ()  # with the head; their experts with the others
    mtp_experts = {id(p) for n, m in experts if n.startswith("mtp_layers.") for p in m.parameters()}
    head = [model.norm.weight, model.output.weight,
            *(p for p in nn.ModuleList(mtp).parameters() if id(p) not in mtp_experts)]
    moe = getattr(args, "moe", None)
    n_experts, top_k = (moe.num_experts, moe.top_k) if moe is not None else (0, 0)
    counts = counting.parameter_counts(model, model.tok_embeddings.weight, head, [m for _, m in experts],
                                       n_experts, top_k)
    return ModelShape(
        n_layers=int(args.n_layers), dim=int(args.dim), vocab_size=int(args.vocab_size),
        n_heads=int(args.n_heads), n_kv_heads=int(args.kv_heads), head_dim=int(args.head_dim),
        ffn_dim=family.ffn_dim(args), tied_embeddings=bool(args.tie_word_embeddings),
        qk_norm=bool(getattr(args, "qk_norm", False)), mtp_layers=len(mtp),
        **counts,
    )
