"""``HFFamily``: the model protocol for any transformers causal LM (``model=hf``).

Everything is read off the architecture itself, never written per architecture:

* counting: the model is built on the meta device and its parameters counted (embedding, blocks,
  final norm + head; routed experts are the modules transformers' expert-parallel plan names, of
  which a token uses ``num_experts_per_tok`` of the config's expert count);
* FLOPs per token: 6 x active matmul parameters + attention's 12 x heads x head_dim per layer
  times the span each layer attends over (a sliding-window layer: at most its window);
* layout: the blocks are ``model.layers`` (``LayerDict``), FSDP wraps the embedding, each layer
  and norm + head (one unit with the embedding when they are tied); TP comes from the config's
  ``base_model_tp_plan`` (``plans.py``); pipeline stages from ``base_model_pp_plan``'s ends.
* refusals, each one line before any process starts: TP without a plan or with a style that has
  no torch counterpart here, PP without a plan or for a model whose forward rescales its input
  embeddings (the stage after the first would scale again), tied embeddings under PP, context
  parallelism (not wired for transformers' attention), EP for a model without transformers'
  top-k experts modules (``base_model_ep_plan``) or with an expert count ep does not divide;
* expert parallel: the experts modules keep their weights as ``Shard(0)`` DTensors over ep and
  exchange their (token, k) rows by all-to-all (``ep.py``, ``TopKExpertParallel``).
"""

from __future__ import annotations

import copy
import functools
import json
from functools import lru_cache
from typing import Any, Mapping

from torch import nn

from titan_hydra.errors import ConfigError
from titan_hydra.models.common import counting
from titan_hydra.models.hf import plans, router
from titan_hydra.models.hf.adapter import HFCheckpointAdapter
from titan_hydra.models.hf.ep import TopKExpertParallel
from titan_hydra.models.hf.model import HFArgs, causal_lm
from titan_hydra.models.hf.stack import block_list, pipeline_ends, stack_ends, stack_owner
from titan_hydra.models.hf.router import expert_count, routed_experts
from titan_hydra.models.protocol import (LimitsSimulation, ModelFamily, ModelShape, RunsStepHooks, WeighsLosses,
                                         fsdp_units_in_order)

# Config keys that say nothing about what the weights compute (checkpoint signature ignores them).
NON_SEMANTIC = ("max_position_embeddings", "use_cache", "dtype", "torch_dtype", "transformers_version",
                "architectures", "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range",
                "output_router_logits", "router_aux_loss_coef", "attention_dropout", "_attn_implementation")


class HFFamily(ModelFamily, WeighsLosses, RunsStepHooks, LimitsSimulation):
    name = "hf"
    args_cls = HFArgs
    model_cls = staticmethod(causal_lm)  # a builder function: the class is the architecture's
    hf = HFCheckpointAdapter()
    supports_document_mask = True  # position ids restart per document; transformers masks across them
    # transformers' model base, imported quietly (~1.5 CPU-s; the architecture's own module is ~0.05 s more)
    worker_imports = ("titan_hydra.models.hf.preload",)

    def simulation_refusal(self, args: HFArgs, device: str, mixed_precision: str) -> str | None:
        if expert_count(args.hf_config) and (device == "cpu" or mixed_precision == "fp32"):
            return ("dry_run=simulate of a model=hf MoE runs its experts in fp32 here, and transformers' grouped GEMM "
                    "has a fake-tensor kernel for bf16 only: simulate the GPU cluster the run targets "
                    "(e.g. cluster=slurm_h100) with training.mixed_precision=bf16")
        return None

    def make_args(self, fields: Mapping[str, Any]) -> HFArgs:
        args = HFArgs(**dict(fields))
        args.hf_config  # noqa: B018 -- a bad architecture or field fails here, in one line
        return args

    def args_fields(self, args: HFArgs) -> dict[str, Any]:
        return {"model_type": args.model_type, "config": args.config, "fields": dict(args.fields),
                "attn_implementation": args.attn_implementation}

    def build(self, args: HFArgs) -> nn.Module:
        return causal_lm(**self.args_fields(args))

    def shape(self, args: HFArgs) -> ModelShape:
        return _shape(self, counting.args_key(self, args))

    def flops_per_token(self, args: HFArgs, seq_len: int) -> float:
        s, cfg = self.shape(args), args.hf_config
        types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * s.n_layers)
        keys = counting.attended_keys(types[:s.n_layers], getattr(cfg, "sliding_window", None), seq_len)
        return counting.flops_per_token(s, keys)

    def signature(self, args: HFArgs) -> dict[str, Any]:
        # what differs from the architecture's defaults, as JSON has it (the checkpoint marker's form)
        cfg = json.loads(json.dumps(args.hf_config.to_diff_dict(), sort_keys=True, default=str))
        return {"family": self.name, "model_type": args.hf_config.model_type,
                **{k: v for k, v in cfg.items() if k not in NON_SEMANTIC and not k.startswith("_")}}

    def check(self, args: HFArgs, dims: Any, seq_len: int) -> None:
        cfg, s = args.hf_config, self.shape(args)
        kind = cfg.model_type
        if seq_len > args.max_seq_len:
            raise ConfigError(f"training.seq_len={seq_len} exceeds the {kind} config's max_position_embeddings="
                              f"{args.max_seq_len}; shorten the sequence or set model.fields.max_position_embeddings")
        if dims.tp > 1:
            if not plans.tp_plan_of(cfg):
                raise ConfigError(f"parallelism.tp={dims.tp}: transformers' {kind} config has no base_model_tp_plan; "
                                  "use parallelism.tp=1")
            odd = plans.unsupported_styles(cfg)
            if odd and (dims.dp_shard > 1 or dims.dp_replicate > 1):
                raise ConfigError(f"parallelism.tp={dims.tp}: the {kind} TP plan's {', '.join(odd)} run whole on "
                                  "every TP rank (plain parameters), which data parallel cannot shard beside TP's; "
                                  "use tp alone, or ep + fsdp for the experts")
            if s.n_heads % dims.tp or s.n_kv_heads % dims.tp:
                raise ConfigError(f"parallelism.tp={dims.tp} must divide num_attention_heads={s.n_heads} and "
                                  f"num_key_value_heads={s.n_kv_heads}")
        if dims.pp > 1:
            if not getattr(cfg, "base_model_pp_plan", None):
                raise ConfigError(f"parallelism.pp={dims.pp}: transformers' {kind} config has no base_model_pp_plan; "
                                  "use parallelism.pp=1")
            if dims.pp > s.n_layers:
                raise ConfigError(f"parallelism.pp={dims.pp} exceeds num_hidden_layers={s.n_layers}; lower parallelism.pp")
            if dims.tp > 1:  # found by dry_run=simulate, then in a real 4-rank run (docs/scaling.md)
                raise ConfigError(f"parallelism.pp={dims.pp} with parallelism.tp={dims.tp} does not run for model=hf: "
                                  "a stage's output leaves transformers' TP plan as a sequence-sharded DTensor, which "
                                  "torch's pipeline stages cannot pass on; use pp or tp, not both")
            if s.tied_embeddings:
                raise ConfigError("tie_word_embeddings=true cannot run under pipeline parallel (embedding and head "
                                  "live on different stages); set model.fields.tie_word_embeddings=false or "
                                  "parallelism.pp=1")
            if float(getattr(cfg, "embedding_multiplier", 1.0) or 1.0) != 1.0:
                raise ConfigError(f"parallelism.pp={dims.pp}: the {kind} forward scales its input embeddings "
                                  "(embedding_multiplier), which a later stage would repeat; use parallelism.pp=1")
        if router.aux_enabled(cfg):
            if not s.n_experts or not getattr(cfg, "num_experts_per_tok", None):
                raise ConfigError(f"model.fields.output_router_logits=true: the {kind} config routes no tokens to "
                                  "experts, so it has no router auxiliary loss; remove the field")
            if dims.pp > 1:  # the loss spans every layer's routing, and a stage holds only its own layers'
                raise ConfigError(f"parallelism.pp={dims.pp} with model.fields.output_router_logits=true: the "
                                  "router's auxiliary loss is one function of every layer's routing, which no "
                                  "pipeline stage holds; use parallelism.pp=1 or drop the aux loss")
        if dims.cp > 1:
            raise ConfigError(f"parallelism.cp={dims.cp} is not wired for model=hf (transformers' attention "
                              "modules); use parallelism.cp=1")
        if dims.ep > 1:
            if not getattr(cfg, "base_model_ep_plan", None) or not _topk_experts(self, counting.args_key(self, args)):
                raise ConfigError(f"parallelism.ep={dims.ep}: transformers' {kind} model has no experts module "
                                  "called with each token's top-k experts (base_model_ep_plan); use parallelism.ep=1")
            if s.n_experts % dims.ep:
                raise ConfigError(f"parallelism.ep={dims.ep} must divide the {kind} config's {s.n_experts} experts; "
                                  "change parallelism.ep")

    # --- layout -------------------------------------------------------------------------
    def blocks(self, model: nn.Module) -> nn.ModuleDict:
        return block_list(model)[1]

    def fsdp_units(self, model: nn.Module) -> list[tuple[Any, bool]]:
        (emb, norm), head = stack_ends(model), model.get_output_embeddings()
        tied = emb is not None and head is not None and head.weight is emb.weight
        ends = [m for m in (norm, head) if isinstance(m, nn.Module) and any(True for _ in m.parameters())]
        # what no unit names (GPT-2's position table, OPT's projections) stays with the root
        return fsdp_units_in_order(emb, list(self.blocks(model).values()), ends, tied)

    def expert_modules(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        return routed_experts(model)

    def expert_parallel_style(self, module: nn.Module) -> TopKExpertParallel:
        return TopKExpertParallel()

    def tp_plan(self, model: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> dict:
        return plans.tp_plan(model, sequence_parallel, loss_parallel)

    def finish_tp(self, model: nn.Module) -> None:
        model.tie_weights()

    # --- training -----------------------------------------------------------------------
    def set_loss_scale(self, model_parts: list[nn.Module], scale: float) -> None:
        router.set_aux_grad_scale(model_parts, scale)

    def step_hooks(self, model_parts: list[nn.Module], dims: Any) -> list:
        """With the router's aux loss on: its data-parallel group (the loss sums the ranks' choices,
        router.py) and its per-step metric ``moe/aux_loss``."""
        if not any(router.aux_enabled(getattr(part, "config", None)) for part in model_parts):
            return []
        mesh = dims.submesh("dp_cp") if dims is not None else None
        router.set_aux_group(model_parts, mesh.get_group() if mesh is not None else None)
        return [functools.partial(router.aux_step, model_parts)]

    def cut_stage(self, model: nn.Module, layer_ids: range, is_first: bool, is_last: bool) -> nn.Module:
        stage = copy.deepcopy(model)
        _, base, _ = stack_owner(stage)
        blocks = self.blocks(stage)
        kept = [k for k in blocks.keys() if int(k) in layer_ids]
        for k in list(blocks.keys()):
            if k not in kept:
                del blocks[k]
        cfg = stage.config  # the stage's own copy: its forward iterates the layers it holds
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = [cfg.layer_types[int(k)] for k in kept]
        cfg.num_hidden_layers = len(kept)
        emb_name, norm_name = pipeline_ends(cfg)
        if not is_first:
            setattr(base, emb_name, None)
        if not is_last:
            setattr(base, norm_name, nn.Identity())
            stage.set_output_embeddings(None)
        return stage


@lru_cache(maxsize=64)
def _topk_experts(family: HFFamily, key: str) -> bool:
    """Whether every experts module is transformers' ``@use_experts_implementation`` kind, called
    as (hidden, top_k_index, top_k_weights): what ``TopKExpertParallel`` dispatches."""
    _, model = counting.meta_build(family, key)
    experts = routed_experts(model)
    return bool(experts) and all(hasattr(m, "_is_expert_parallel") for _, m in experts)


@lru_cache(maxsize=64)
def _shape(family: HFFamily, key: str) -> ModelShape:
    args, model = counting.meta_build(family, key)
    cfg = args.hf_config
    embedding, norm = stack_ends(model)
    emb = embedding.weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is emb
    head_tensors = [*(norm.parameters() if isinstance(norm, nn.Module) else ()),
                    *([head.weight] if head is not None else ())]
    experts = [m for _, m in routed_experts(model)]
    n_experts = expert_count(cfg)
    counts = counting.parameter_counts(model, emb, head_tensors, experts, n_experts,
                                       int(getattr(cfg, "num_experts_per_tok", 0) or 0))
    top_k = counts["top_k"]
    n_heads = int(getattr(cfg, "num_attention_heads", None) or 1)  # an attention-free stack (Mamba): one
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads)
    ffn = int(getattr(cfg, "intermediate_size", 0) or 0)
    if experts:
        moe_ffn = int(getattr(cfg, "moe_intermediate_size", 0) or ffn)
        ffn = top_k * moe_ffn + int(getattr(cfg, "n_shared_experts", 0) or 0) * moe_ffn
    return ModelShape(
        n_layers=int(cfg.num_hidden_layers), dim=int(cfg.hidden_size), vocab_size=int(cfg.vocab_size),
        n_heads=n_heads, n_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or n_heads), head_dim=head_dim,
        ffn_dim=ffn, tied_embeddings=tied, qk_norm=any(n.endswith("q_norm") for n, _ in model.named_modules()),
        **counts,
    )
