"""Mixture-of-Experts feed-forward: token-choice top-k routing, grouped experts, load balancing.

Why it is built this way:

* Routing runs in fp32, the gate matmul included (inputs and gate weight upcast, autocast off),
  so that every layout (bf16 FSDP parameters, autocast, expert parallel) picks the same experts
  for the same tokens. A bf16 near-tie resolved differently would move a token to another
  expert and make layouts diverge far beyond rounding.
* ``expert_bias`` (DeepSeek-V3's auxiliary-loss-free balancing) is added to the scores only to
  *choose* experts; the gate values that weight expert outputs come from the unbiased scores.
  The bias steers load without entering the function the model computes for a given choice.
* Dispatch is local: the (token, expert) pairs are sorted by expert (stable sort), so each
  expert's rows are contiguous and ``GroupedExperts`` runs one grouped GEMM per projection
  (``torch._grouped_mm``, where ``kernels/grouped_mm.py`` finds that it works) over all
  experts. ``GroupedExperts.forward(x, counts)`` is the cut expert parallelism wraps (all-to-all
  around it), so the router and combine never know about EP. Outputs are weighted by their gates and summed back into token order in fp32.
* Load is counted per optimizer step (training forwards only, not an activation-checkpoint
  recompute) in a buffer; a training hook (``train/moe_balance.py``) sums it over the
  data-parallel ranks once per step and moves the bias, so this module never communicates.
* The optional sequence-wise auxiliary loss (DeepSeek-V3) reaches the gradient through an
  autograd function on the layer output, so the loss function's signature stays ``(logits,
  labels)`` and pipeline stages need nothing extra.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from titan_hydra.kernels.grouped_mm import grouped_mm_works, probe_grouped_mm
from titan_hydra.models.common.cast_cache import WeightCastCache
from titan_hydra.models.common.layers import FeedForward, local_part, trunc_normal_

SCORE_FUNCS = ("softmax", "sigmoid")


@dataclass(kw_only=True)
class MoEArgs:
    """The ``model.moe`` node. The expert count, top-k and expert width are shapes: no default
    (each flavor's yaml sets them); the routing and balancing conventions default here."""

    num_experts: int
    top_k: int
    expert_dim: int  # hidden width of one routed expert (HF moe_intermediate_size)
    num_shared_experts: int = 0  # shared FFN hidden width = num_shared_experts * expert_dim
    score_func: str = "softmax"  # "softmax" | "sigmoid"; computed in fp32
    route_norm: bool = False  # renormalize the k gate values to sum 1 (HF norm_topk_prob)
    route_scale: float = 1.0  # HF routed_scaling_factor
    num_expert_groups: int = 1  # HF n_group (group-limited routing; 1 = off)
    num_limited_groups: int = 1  # HF topk_group
    load_balance_coeff: float = 1e-3  # aux-loss-free bias update rate; 0 = off (bias stays put)
    aux_loss_coeff: float = 0.0  # sequence-wise auxiliary loss weight; 0 = off
    use_grouped_mm: bool = True  # False = per-expert loop (benchmark baseline, fallback)
    # Pad each expert's rows to a bucketed count (flat CPU memory in bf16, see buckets_rows);
    # None = on CPU in bf16/fp16 only.
    bucket_rows: Optional[bool] = None
    # Weight each token's expert *input* by its gate instead of the expert's output (Llama 4; the
    # same only for linear experts): expert(g * x) rather than g * expert(x).
    score_before_experts: bool = False

    def __post_init__(self) -> None:
        e, k, g = self.num_experts, self.top_k, self.num_expert_groups
        if e < 1 or self.expert_dim < 1:
            raise ValueError(f"model.moe.num_experts={e} and model.moe.expert_dim={self.expert_dim} must be >= 1")
        if not 1 <= k <= e:
            raise ValueError(f"model.moe.top_k={k} must be between 1 and model.moe.num_experts={e}")
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"model.moe.score_func={self.score_func!r} must be one of {', '.join(SCORE_FUNCS)}")
        if g < 1 or e % g:
            raise ValueError(f"model.moe.num_expert_groups={g} must divide model.moe.num_experts={e}")
        if not 1 <= self.num_limited_groups <= g:
            raise ValueError(f"model.moe.num_limited_groups={self.num_limited_groups} must be between 1 and "
                             f"model.moe.num_expert_groups={g}")
        if k > self.num_limited_groups * (e // g):
            raise ValueError(f"model.moe.top_k={k} exceeds the {self.num_limited_groups} x {e // g} experts "
                             "that group-limited routing leaves; raise model.moe.num_limited_groups")
        if self.num_shared_experts < 0 or self.load_balance_coeff < 0 or self.aux_loss_coeff < 0:
            raise ValueError("model.moe.num_shared_experts, load_balance_coeff and aux_loss_coeff must be >= 0")

    @classmethod
    def of(cls, value: "MoEArgs | dict[str, Any] | None") -> "MoEArgs":
        """From a config dict (Hydra node) or an MoEArgs; unknown keys are a one-line error."""
        if isinstance(value, cls):
            return value
        value = dict(value or {})
        unknown = sorted(set(value) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"model.moe has unknown keys {unknown}")
        return cls(**value)

    @property
    def shared_dim(self) -> int:
        return self.num_shared_experts * self.expert_dim


# ------------------------------------------------------------------------------------ router


class TokenChoiceRouter(nn.Module):
    """Each token picks its top-k experts by fp32 score (softmax or sigmoid of a linear gate)."""

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.num_experts = args.num_experts
        self.top_k = args.top_k
        self.score_func = args.score_func
        self.route_norm = args.route_norm
        self.route_scale = args.route_scale
        self.num_expert_groups = args.num_expert_groups
        self.num_limited_groups = args.num_limited_groups
        self.gate = nn.Linear(dim, args.num_experts, bias=False)

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> fp32 scores [T, E] (the gate matmul in fp32 too, autocast or not)."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x.float(), self.gate.weight.float())
        return logits.softmax(dim=-1) if self.score_func == "softmax" else logits.sigmoid()

    def choose(self, scores: torch.Tensor, expert_bias: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate values [T, k] fp32, chosen experts [T, k] int64) from scores [T, E].

        The bias shifts only the choice. Group-limited routing (num_expert_groups > 1) first
        keeps the ``num_limited_groups`` groups whose two best biased scores sum highest
        (DeepSeek-V3's rule) and chooses the k experts within them.
        """
        choice = scores if expert_bias is None else scores + expert_bias.float()
        if self.num_expert_groups > 1:
            t, g = choice.shape[0], self.num_expert_groups
            grouped = choice.view(t, g, self.num_experts // g)
            group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
            kept = group_score.topk(self.num_limited_groups, dim=-1).indices
            dropped = torch.ones(t, g, dtype=torch.bool, device=choice.device).scatter(1, kept, False)
            choice = grouped.masked_fill(dropped.unsqueeze(-1), float("-inf")).view(t, self.num_experts)
        selected = choice.topk(self.top_k, dim=-1).indices
        gates = scores.gather(1, selected)
        if self.route_norm:
            gates = gates / (gates.sum(dim=-1, keepdim=True) + 1e-20)
        return gates * self.route_scale, selected

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] -> (gates [T, k] fp32, selected [T, k] int64, counts [E] int64)."""
        gates, selected = self.choose(self.scores(x), expert_bias)
        return gates, selected, expert_counts(selected, self.num_experts)

    def init_weights(self, std: float = 0.02) -> None:
        trunc_normal_(self.gate.weight, std)


def expert_counts(selected: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens per expert [E] int64 (a static-shape scatter, unlike bincount)."""
    flat = selected.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


# ----------------------------------------------------------------------------------- experts

def buckets_rows(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether expert rows are padded to bucketed counts: on CPU in bf16/fp16.

    oneDNN keeps a kernel and workspace per matmul shape in reduced precision and an expert's row
    count changes every step, so unpadded rows grow resident memory step after step; bucketed counts
    repeat. GPUs and fp32 CPU matmuls keep no per-shape state, so they run unpadded.
    """
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)


def bucket_counts(counts: torch.Tensor, min_step: int = 32) -> torch.Tensor:
    """Each count rounded up to a multiple of max(min_step, 2^floor(log2 count) / 8): at most
    12.5% padding above 8 x min_step rows, and about eight sizes per doubling. 0 stays 0.

    ``min_step`` trades padding (a smaller step pads less) against the number of distinct shapes
    oneDNN keeps state for (a larger step makes fewer); the default keeps both small
    (docs/bench/notes_models.md)."""
    octave = torch.exp2(torch.floor(torch.log2(counts.clamp_min(1).double()))).long()
    step = (octave // 8).clamp_min(min_step)
    return (counts + step - 1) // step * step


def pad_to_buckets(x: torch.Tensor, counts: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows grouped by expert ([N, D], ``counts`` each) -> (the same groups zero-padded to
    ``bucket_counts``, the padded counts, the index of each original row in the padded tensor).

    The caller keeps only ``rows`` of the experts' output, so no gradient reaches a padded row
    (nor, through it, a weight): the result and every gradient equal the unpadded computation's.
    """
    padded_counts = bucket_counts(counts)
    shift = (torch.cumsum(padded_counts, 0) - padded_counts) - (torch.cumsum(counts, 0) - counts)
    n = x.shape[0]
    rows = torch.arange(n, device=x.device) + torch.repeat_interleave(shift, counts, output_size=n)
    padded = x.new_zeros(int(padded_counts.sum()), x.shape[1]).index_copy(0, rows, x)
    return padded, padded_counts, rows


class GroupedExperts(nn.Module):
    """E SwiGLU experts with stacked weights: w2_e(silu(w1_e x) * w3_e x).

    ``forward(x, counts)``: x [N, D] holds expert 0's rows, then expert 1's, ... (``counts[e]``
    rows each, N == counts.sum()); returns [N, D] in the same order. Under expert parallel the
    weights are sharded on dim 0 and this sees only its local experts and their tokens.
    """

    routed_experts = True  # ModelFamily.expert_modules finds these

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool = True,
                 bucket_rows: bool | None = None):
        super().__init__()
        self.num_experts = num_experts
        self.use_grouped_mm = use_grouped_mm
        self.bucket_rows = bucket_rows
        self.cast_cache = WeightCastCache()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # torch._grouped_mm has no autocast rule: run in autocast's dtype ourselves; without
        # autocast in the activations' dtype (FSDP's bf16 compute, with fp32 expert weights
        # when FSDP leaves the experts out, parallel/fsdp.py).
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        x = x.to(dtype)
        if not (buckets_rows(x.device, dtype) if self.bucket_rows is None else self.bucket_rows):
            return self.run(x, counts, dtype)
        padded, padded_counts, rows = pad_to_buckets(x, counts)
        return self.run(padded, padded_counts, dtype).index_select(0, rows)

    def grouped(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether the experts run as one grouped GEMM here (else a loop over experts). One rule for
        every experts module: the simulator's GPU routing replaces ``grouped_mm_works`` for all."""
        return self.use_grouped_mm and grouped_mm_works(device, dtype)

    def run(self, x: torch.Tensor, counts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The experts on rows already in ``dtype`` (subclasses change the expert function here)."""
        w1, w2, w3 = self.weights_in(dtype, self.w1, self.w2, self.w3)
        if self.grouped(x.device, dtype):
            return grouped_swiglu(x, w1, w2, w3, counts)
        return looped_swiglu(x, w1, w2, w3, counts)

    def weights_in(self, dtype: torch.dtype, *params: torch.Tensor) -> list[torch.Tensor]:
        """This rank's part of each weight in ``dtype``, cast once per optimizer step (cast_cache)."""
        return [self.cast_cache.cast(i, local_part(p), dtype) for i, p in enumerate(params)]

    def init_weights(self, out_std: float, in_std: float = 0.02) -> None:
        trunc_normal_(self.w1, in_std)
        trunc_normal_(self.w3, in_std)
        trunc_normal_(self.w2, out_std)
        probe_grouped_mm(self.w1.device)


def grouped_swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                   counts: torch.Tensor) -> torch.Tensor:
    """One grouped GEMM per projection; group e = rows offs[e-1]:offs[e]."""
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs))
    h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
    return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)


def looped_swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                  counts: torch.Tensor) -> torch.Tensor:
    """One matmul per expert (needs the counts on the host)."""
    outs = []
    for e, rows in enumerate(torch.split(x, counts.tolist())):
        h = F.silu(rows @ w1[e].transpose(0, 1)) * (rows @ w3[e].transpose(0, 1))
        outs.append(h @ w2[e].transpose(0, 1))
    return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])


# ---------------------------------------------------------------------------------------- MoE


class InjectAuxLoss(torch.autograd.Function):
    """Identity on the layer output whose backward also sends d(aux)/d(aux) = 1 into ``aux``,
    i.e. adds ``aux`` to whatever loss the output reaches."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=grad.device)


def sequence_balance_loss(scores: torch.Tensor, selected: torch.Tensor, num_experts: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, mean over the batch's sequences (unweighted).

    scores [B, S, E] (fp32), selected [B, S, k]: per sequence, sum_i f_i * P_i with
    f_i = E / (k S) * (tokens choosing expert i) and P_i = the mean over tokens of the scores
    normalized to sum 1 per token. Gradient flows through P only.
    """
    b, s, k = selected.shape
    probs = scores / scores.sum(dim=-1, keepdim=True)
    mean_prob = probs.mean(dim=1)  # [B, E]
    hits = torch.zeros(b, num_experts, dtype=scores.dtype, device=scores.device)
    hits.scatter_add_(1, selected.reshape(b, s * k), torch.ones(b, s * k, dtype=scores.dtype, device=scores.device))
    frac = hits * (num_experts / (k * s))
    return (frac * mean_prob).sum(dim=-1).mean()


def recomputing() -> bool:
    """Whether this forward runs inside a backward pass: an activation-checkpoint recompute (or the
    backward of torch's pipeline shape probe). Such a forward repeats one already counted, so it
    must not count its tokens again. (The autograd engine's graph-task id is what torch's own
    checkpoint code reads; -1 outside a backward.)"""
    return torch._C._current_graph_task_id() != -1


class MoE(nn.Module):
    """Routed experts (+ optional shared experts) in place of a block's FFN: [B, S, D] -> [B, S, D].

    Buffers: ``expert_bias`` [E] fp32 (persistent, so a resumed run chooses exactly as the
    uninterrupted one), ``tokens_per_expert`` [E] fp32 (this optimizer step's load, training
    forwards only; the step's balancing hook reads and resets it).

    Auxiliary loss scaling: with ``aux_loss_coeff`` > 0 each training forward adds
    ``aux_loss_coeff * aux_grad_scale * sequence_balance_loss`` of its own microbatch to the
    gradient. The injection does not see the runner's loss scaling (``loss / grad_accum_steps``,
    and the pipeline's division by its microbatch count): with N microbatches per optimizer step
    the aux term is summed over them, N times the weight it has when the same sequences form one
    batch, unless ``aux_grad_scale`` is set to 1/N (``set_aux_grad_scale``). Data-parallel
    gradient averaging treats it like the main loss (a mean over ranks). Under context parallel
    a "sequence" is the rank's chunk of it.
    """

    def __init__(self, dim: int, args: MoEArgs | dict[str, Any]):
        super().__init__()
        self.args = args = MoEArgs.of(args)
        self.router = TokenChoiceRouter(dim, args)
        self.experts = GroupedExperts(dim, args.expert_dim, args.num_experts, args.use_grouped_mm, args.bucket_rows)
        self.shared_experts = FeedForward(dim, args.shared_dim) if args.num_shared_experts else None
        self.register_buffer("expert_bias", torch.zeros(args.num_experts, dtype=torch.float32), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts, dtype=torch.float32),
                             persistent=False)
        self.aux_grad_scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        tokens = x.reshape(-1, d)
        scores = self.router.scores(tokens)
        gates, selected = self.router.choose(scores, self.expert_bias)
        counts = expert_counts(selected, self.args.num_experts)
        if self.training and not recomputing():
            with torch.no_grad():
                self.tokens_per_expert.add_(counts.to(self.tokens_per_expert.dtype))
        # local dispatch: (token, choice) pairs sorted by expert
        order = torch.argsort(selected.reshape(-1), stable=True)
        token_of_row = order // self.args.top_k
        rows, row_gates = tokens[token_of_row], gates.reshape(-1)[order].unsqueeze(-1)
        if self.args.score_before_experts:
            routed = self.experts((rows.float() * row_gates).to(rows.dtype), counts).float()
        else:
            routed = self.experts(rows, counts).float() * row_gates
        out = torch.zeros(b * s, d, dtype=torch.float32, device=x.device).index_add(0, token_of_row, routed)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens).float()
        out = out.to(x.dtype).view(b, s, d)
        if self.training and self.args.aux_loss_coeff > 0 and torch.is_grad_enabled():
            aux = sequence_balance_loss(scores.view(b, s, -1), selected.view(b, s, -1), self.args.num_experts)
            out = InjectAuxLoss.apply(out, aux * (self.args.aux_loss_coeff * self.aux_grad_scale))
        return out

    def init_weights(self, out_std: float, in_std: float = 0.02) -> None:
        self.router.init_weights(in_std)
        self.experts.init_weights(out_std, in_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(out_std, in_std)
        with torch.no_grad():
            self.expert_bias.zero_()
            self.tokens_per_expert.zero_()


# ------------------------------------------------------------------------------- per step


def moe_modules(model_parts: Iterable[nn.Module]) -> list[tuple[str, MoE]]:
    return [(name, m) for part in model_parts for name, m in part.named_modules() if isinstance(m, MoE)]


def set_aux_grad_scale(model_parts: Iterable[nn.Module], scale: float) -> None:
    """Weight of each microbatch's aux-loss gradient (1/N with N accumulated microbatches)."""
    for _, m in moe_modules(model_parts):
        m.aux_grad_scale = float(scale)
