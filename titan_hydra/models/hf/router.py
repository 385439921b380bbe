"""transformers' MoE routers under the engine (``model=hf``): per-expert load and the auxiliary loss.

transformers' MoE layers leave two things to their caller that the native MoE does itself:

* Load. A forward pre-hook on each experts module (called as ``experts(hidden, top_k_index,
  top_k_weights)``; ``prepend``, so it sees the global expert ids before expert parallel's
  dispatch hook) adds the tokens each expert was chosen for to a ``tokens_per_expert`` buffer
  on the MoE block: training forwards only, not an activation-checkpoint recompute. It is the
  native MoE's buffer, read and reset once per optimizer step by train/moe_balance.py (the
  ``moe/*`` load metrics). The hook only reads what the block chose: the model's math is
  unchanged. int64, so the NaN check of ``TitanForward.init_weights`` (floating buffers) leaves
  it alone; ``zero_counts`` gives it its start.
* The auxiliary load-balancing loss, on by transformers' own switch: ``output_router_logits=True``
  with the architecture's ``router_aux_loss_coef``. transformers adds ``coef * aux`` to its loss
  only when given labels, and the engine computes the loss itself, so the forward adds the same
  term to the gradient (``inject_aux``, on the logits: the loss function keeps its ``(logits,
  labels)`` signature, as the native MoE's aux loss does). The router logits come from a forward
  hook on each module transformers itself records them from (the architecture's
  ``_can_record_outputs["router_logits"]``), appending to a list the forward reads: transformers'
  own recorder reads a ``ContextVar`` inside the layers, which a per-block ``torch.compile`` cannot
  trace, while a list append is a side effect dynamo replays.

The loss is transformers' Switch loss, E * sum_e f_e * P_e, with f_e the share of top-k choices
and P_e the mean routing probability of expert e over every layer's tokens. It is not a mean
over tokens, so a data-parallel rank's loss on its own batch is not its share of the global
batch's. Here f and the row count are summed over the data-parallel ranks (no gradient flows
through f), and each rank back-propagates E * sum_e f_e * P_e(its own tokens): the ranks'
average gradient (what data parallel applies) is the gradient of the global batch's loss, the
one a single process computes. Gradient accumulation weighs each microbatch's loss by the
runner's loss scale, as the native MoE does.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from titan_hydra.models.common.moe import InjectAuxLoss, expert_counts, recomputing

EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
COEFFICIENT_KEYS = ("router_aux_loss_coef", "aux_loss_coef")


def routed_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(fqn, module) of the experts modules: ``*.experts`` holding 3-D [E, ...] weights."""
    return [(n, m) for n, m in model.named_modules() if n.endswith(".experts")
            and any(p.dim() == 3 for p in m.parameters(recurse=False))]


def aux_enabled(cfg: Any) -> bool:
    """Whether the config asks for the router's auxiliary loss (transformers' own switch)."""
    return bool(getattr(cfg, "output_router_logits", False))


def expert_count(cfg: Any) -> int:
    return next((int(getattr(cfg, k)) for k in EXPERT_COUNT_KEYS if getattr(cfg, k, None)), 0)


# ------------------------------------------------------------------------------------- load


def install_counters(model: nn.Module) -> None:
    """A ``tokens_per_expert`` buffer on each MoE block, filled by a pre-hook on its experts."""
    blocks = dict(model.named_modules())
    for name, experts in routed_experts(model):
        if not hasattr(experts, "_is_expert_parallel"):  # not called with top-k ids: nothing to count
            continue
        block = blocks[name.rpartition(".")[0]]
        n = next(p for p in experts.parameters(recurse=False) if p.dim() == 3).shape[0]
        block.register_buffer("tokens_per_expert", torch.zeros(n, dtype=torch.int64, device=experts_device(experts)),
                              persistent=False)
        experts.register_forward_pre_hook(functools.partial(_count, block), prepend=True)


def experts_device(experts: nn.Module) -> torch.device:
    return next(experts.parameters()).device


def _count(block: nn.Module, experts: nn.Module, args: tuple) -> None:
    if not experts.training or recomputing():
        return
    with torch.no_grad():
        counts = block.tokens_per_expert
        counts.add_(expert_counts(args[1], counts.numel()))


def zero_counts(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(getattr(m, "tokens_per_expert", None), torch.Tensor) and not m.tokens_per_expert.is_meta:
            with torch.no_grad():
                m.tokens_per_expert.zero_()


# -------------------------------------------------------------------------------- aux loss


class NoRouterLogits(Exception):
    """The architecture declares no module its router logits are recorded from."""


def install_logit_capture(model: nn.Module) -> None:
    """With the aux loss on: ``model.router_logits_sink``, the list each router's forward hook
    appends its logits to in training. The routers may run compiled (per-block compile compiles
    around the eager experts), where the recompute test of the counting hook cannot be traced:
    an activation-checkpoint recompute appends too, after its forward took the list, and the
    next forward starts by emptying it (``take_logits``)."""
    if not aux_enabled(model.config):
        return
    specs = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    if specs is None:
        raise NoRouterLogits("its modeling code records no router_logits")
    if coefficient(model.config) is None:
        raise NoRouterLogits("its config has no router_aux_loss_coef")
    sink: list[torch.Tensor] = []
    for spec in specs if isinstance(specs, (list, tuple)) else [specs]:  # JetMoE: attention's and the MLP's
        target, index = (spec, 0) if isinstance(spec, type) else (spec.target_class, spec.index)
        layer = f".{spec.layer_name.strip('.')}." if getattr(spec, "layer_name", None) else None
        for name, m in model.named_modules():
            if isinstance(m, target) and (layer is None or layer in f".{name}."):
                m.register_forward_hook(functools.partial(_keep_logits, sink, index))
    model.router_logits_sink = sink


def coefficient(cfg: Any) -> float | None:
    """The aux loss's weight under the config's name for it (JetMoE: ``aux_loss_coef``)."""
    value = next((getattr(cfg, k) for k in COEFFICIENT_KEYS if getattr(cfg, k, None) is not None), None)
    return None if value is None else float(value)


def _keep_logits(sink: list, index: int, module: nn.Module, args: tuple, output: Any) -> None:
    if module.training:
        sink.append(output[index] if isinstance(output, tuple) else output)


def clear_logits(model: nn.Module) -> None:
    sink = getattr(model, "router_logits_sink", None)
    if sink is not None:
        sink.clear()


def take_logits(model: nn.Module) -> list[torch.Tensor]:
    """This forward's router logits, in layer order; the list emptied for the next."""
    logits = list(model.router_logits_sink)
    clear_logits(model)
    return logits


def balance_sums(router_logits: Iterable[torch.Tensor], num_experts: int, top_k: int
                 ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Over every layer's rows: top-k choices per expert (no gradient), routing probability per
    expert (summed; differentiable) and the row count, as transformers' ``load_balancing_loss_func``
    computes them (softmax of the logits in their dtype, top-k of it)."""
    chosen = probs = None
    rows = 0
    for logits in router_logits:
        if logits is None:  # a dense layer of a mixed stack
            continue
        p = torch.softmax(logits, dim=-1)
        hits = expert_counts(torch.topk(p, top_k, dim=-1).indices, num_experts)
        chosen = hits if chosen is None else chosen + hits
        probs = p.float().sum(0) if probs is None else probs + p.float().sum(0)
        rows += p.shape[0]
    return chosen.float(), probs, float(rows)


def aux_loss(router_logits: Iterable[torch.Tensor], num_experts: int, top_k: int, group: Any = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(what this rank back-propagates, the global batch's aux loss value, detached): see the
    module docstring. ``group``: the data-parallel process group, or None in one process."""
    chosen, probs, rows = balance_sums(router_logits, num_experts, top_k)
    local_rows = rows
    if group is not None and dist.get_world_size(group) > 1:
        sums = torch.cat([chosen, probs.detach(), chosen.new_tensor([rows])])
        dist.all_reduce(sums, group=group)
        chosen, global_probs, rows = sums[:num_experts], sums[num_experts:-1], float(sums[-1])
    else:
        global_probs = probs.detach()
    share = chosen / rows  # in transformers' order of operations: one process rounds as it does
    backprop = (share * (probs / local_rows)).sum() * num_experts
    value = (share * (global_probs / rows)).sum() * num_experts
    return backprop, value


def inject_aux(model: nn.Module, out: torch.Tensor, router_logits: Iterable[torch.Tensor]) -> torch.Tensor:
    """``out`` (the logits), whose backward also carries ``coef * scale * aux``; the value is
    accumulated (weighted like the microbatch's loss) for the step's ``moe/aux_loss``."""
    cfg = model.config
    scale = float(getattr(model, "aux_grad_scale", 1.0))
    backprop, value = aux_loss(router_logits, expert_count(cfg), int(cfg.num_experts_per_tok),
                               getattr(model, "aux_group", None))
    model.aux_value = value * scale + getattr(model, "aux_value", 0.0)
    return InjectAuxLoss.apply(out, backprop * (coefficient(cfg) * scale))


def set_aux_grad_scale(model_parts: Iterable[nn.Module], scale: float) -> None:
    for part in model_parts:
        part.aux_grad_scale = float(scale)


def set_aux_group(model_parts: Iterable[nn.Module], group: Any) -> None:
    for part in model_parts:
        part.aux_group = group


def aux_step(model_parts: list[nn.Module]) -> dict[str, float]:
    """Once per optimizer step: the step's auxiliary loss (unweighted by its coefficient; the mean
    over the step's microbatches of the global batch's value), reset for the next."""
    values = [part.__dict__.pop("aux_value", None) for part in model_parts]
    values = [v for v in values if v is not None]
    return {"moe/aux_loss": float(sum(values))} if values else {}
