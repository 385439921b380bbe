"""transformers' own parallel plans, read for the engine: TP styles, pipeline ends, expert modules.

An architecture's config class carries ``base_model_tp_plan`` ({"layers.*.self_attn.q_proj":
"colwise", ...}), ``base_model_pp_plan`` (the base model's children in forward order: embedding,
layers, final norm) and, for MoE, ``base_model_ep_plan``. They are written for transformers' own
``tp_plan="auto"`` path; here each style name becomes the torch ``ParallelStyle`` that does the same
(``STYLES``) and the plan is completed with what transformers leaves to its own hooks: the embedding
(row-wise over the vocabulary), the head (column-wise; vocab-sharded logits for loss parallel), the
norms (sequence parallel, or replicated DTensors), and, under sequence parallel, the gathers that
bring each sub-layer its whole sequence. A sub-layer whose plan uses a style with no torch counterpart
here (transformers' packed MoE styles: ``packed_colwise``, ``moe_tp_experts``) runs whole on every TP rank
with plain parameters: the same gathered input on every rank gives the same gradients, so nothing needs
reducing; its memory is not split (``ep`` shards experts). Beside data parallel that mix of plain and TP
parameters cannot be sharded, so that combination is refused in one line.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from titan_hydra.models.hf.stack import end_names, is_norm, stack_owner

# transformers' style name -> (kind, torch arguments); built lazily (DTensor imports take a second)
KNOWN_STYLES = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input",
                "replicated_with_grad_allreduce")


def tp_plan_of(config: Any) -> dict[str, str]:
    return dict(getattr(config, "base_model_tp_plan", None) or {})


def unsupported_styles(config: Any) -> list[str]:
    return sorted({s for s in tp_plan_of(config).values() if s not in KNOWN_STYLES})


def _exists(base: nn.Module, fqn: str) -> bool:
    """Whether the plan's module is in this model (an MoE model's dense-MLP entries name modules only
    its dense layers have)."""
    try:
        base.get_submodule(fqn)
    except AttributeError:
        return False
    return True


def expand(plan: dict[str, str], layer_keys: list[str], attr: str = "layers") -> dict[str, str]:
    """``layers.*.x`` -> ``layers.<k>.x`` for the layers this model (or stage) holds (``attr``: the
    block list's name on its owner)."""
    out: dict[str, str] = {}
    star = f"{attr}.*."
    for pattern, style in plan.items():
        if pattern.startswith(star):
            for k in layer_keys:
                out[f"{attr}.{k}.{pattern[len(star):]}"] = style
        else:
            out[pattern] = style
    return out


def tp_plan(model: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> dict:
    """{fqn: ParallelStyle} for ``parallelize_module`` on the whole causal LM (or one stage)."""
    # Lazy: torch.distributed.tensor takes about a second to import; only TP runs need it.
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    from titan_hydra.models.common.tp_styles import HeadShardedNorm, ReplicateParallel  # lazy: see above

    seq = Shard(1) if sequence_parallel else Replicate()
    prefix, base, attr = stack_owner(model)  # the plan's names are relative to the stack's owner
    layer_keys = list(getattr(base, attr).keys())

    def style(name: str):
        return {
            "colwise": lambda: ColwiseParallel(),
            "rowwise": lambda: RowwiseParallel(output_layouts=seq, use_local_output=not sequence_parallel),
            "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
            "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=seq,
                                                           use_local_output=not sequence_parallel),
            "replicated_with_grad_allreduce": lambda: HeadShardedNorm(),
        }[name]()

    def norm_style():
        return SequenceParallel() if sequence_parallel else ReplicateParallel()

    own = {k: v for k, v in expand(tp_plan_of(model.config), layer_keys, attr).items() if _exists(base, k)}
    # A sub-layer whose plan names a style torch has no counterpart for here (transformers' packed MoE
    # styles) runs whole on every TP rank: plain parameters, the gathered sequence in (identical on
    # every rank, so are its gradients), the sequence shard out.
    whole = {".".join(k.split(".")[:3]) for k, v in own.items() if v not in KNOWN_STYLES}
    own = {k: v for k, v in own.items() if ".".join(k.split(".")[:3]) not in whole}
    plan: dict = {prefix + k: style(v) for k, v in own.items()}
    emb_name, norm_name = end_names(model)
    if emb_name is not None:
        # Under sequence parallel the residual stream stays a DTensor of the whole sequence's shape, so
        # the masks transformers builds from it (eager and sliding-window layers) have its length.
        plan[prefix + emb_name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq,
                                                  use_local_output=not sequence_parallel)
    if norm_name is not None:
        plan[prefix + norm_name] = norm_style()
    if model.get_output_embeddings() is not None:
        plan["lm_head"] = ColwiseParallel(input_layouts=seq,
                                          output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                          use_local_output=not loss_parallel)
    for key in layer_keys:
        plan.update(_layer_plan(base, prefix, attr, key, own, whole, sequence_parallel, norm_style))
    return plan


def _layer_plan(base: nn.Module, prefix: str, attr: str, key: str, own: dict[str, str], whole: set[str],
                sequence_parallel: bool, norm_style) -> dict:
    """What the config's plan leaves to transformers' hooks inside layer ``key``: the gathers into each
    planned (or whole-running) sub-layer, replicated DTensors for its other weights, the norms."""
    from titan_hydra.models.common.tp_styles import GatherSequence, ReplicateParallel  # lazy: see tp_plan

    plan: dict = {}
    lp = f"{prefix}{attr}.{key}."
    for child_name, child in getattr(base, attr)[key].named_children():
        planned = [n for n in own if n.startswith(f"{attr}.{key}.{child_name}.")]
        if f"{attr}.{key}.{child_name}" in whole:
            if sequence_parallel:
                plan[lp + child_name] = GatherSequence(scatter_output=True)
        elif planned:
            if sequence_parallel:
                plan[lp + child_name] = GatherSequence()
            for sub_name, sub in child.named_modules():
                fqn = f"{attr}.{key}.{child_name}.{sub_name}"
                if sub_name and fqn not in own and any(True for _ in sub.parameters(recurse=False)):
                    plan[prefix + fqn] = ReplicateParallel()  # e.g. a norm over the gathered q
        elif any(True for _ in child.parameters()):
            plan[lp + child_name] = norm_style() if is_norm(child) else ReplicateParallel()
    return plan
