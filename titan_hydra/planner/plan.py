"""The plan of a run: parameters, FLOPs and per-rank memory, without allocating; and its report.

Used by ``dry_run=true``, ``recipes/estimate.py`` and ``parallelism=auto``. Per-rank peak memory =
parameters + AdamW state + the larger of (activations saved for backward, gradients + optimizer
temporaries), split by the layout (FSDP shards, TP splits, PP stages, CP sequence chunks), by
mixed precision and by activation-checkpoint mode. This module only combines the terms: the
measured activation coefficients are in activations.py, the CUDA allocator model in
cuda_memory.py, the pipeline schedule in pipeline.py, device facts in devices.py. A plan fits
when its peak leaves ``cluster.memory_headroom`` of the device free: the estimate's measured
error against real peaks, so that what fits on paper fits on the device.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from titan_hydra.models.protocol import ModelShape, SizesSamples
from titan_hydra.planner.activations import (
    activation_bytes,
    head_activation_bytes,
    linear_attention_bytes,
    moe_activation_bytes,
    precision_kind,
)
from titan_hydra.planner.attention import fp32_attention_bytes
from titan_hydra.planner.cuda_memory import (
    ALLOCATOR_RESERVE_COMPILED,
    ALLOCATOR_RESERVE_EAGER,
    cuda_dynamic_peak,
)
from titan_hydra.planner.devices import device_memory_of, peak_tflops_of, usable_memory_of
from titan_hydra.planner.runtime import TITAN_HYDRA, Runtime
from titan_hydra.planner.shape import expert_shard_padding, largest_block_params, stage_params
from titan_hydra.spec import RunSpec

GIB = 1024**3
ASSUMED_MFU = 0.4  # the model FLOP utilization a plan's step time assumes (Plan.step_time_s_at_mfu40)


def alltoall_bytes(args: ModelShape, kind: str, tokens: float, moe_layers: float, ep: int) -> float:
    """Bytes one rank sends per step through expert parallelism's all-to-all: each MoE layer
    dispatches and combines top_k copies of every token, forward and backward (4 passes); the
    share that stays on the rank ((ep-1)/ep leaves it) is free."""
    if ep <= 1 or not args.n_experts:
        return 0.0
    elem = 4 if kind == "fp32" else 2
    return 4 * moe_layers * args.top_k * tokens * args.dim * elem * (ep - 1) / ep


@dataclass
class Plan:
    """What ``plan`` returns (memory in GiB per rank); ``format`` is the report a dry run prints."""

    flavor: str
    params: int
    non_embedding_params: int
    flops_per_token: float
    tokens_per_step: int
    flops_per_step: float
    world_size: int
    layout: str
    grad_accum_steps: int
    mem_params_gib: float
    mem_grads_gib: float
    mem_optimizer_gib: float
    mem_activations_gib: float
    mem_total_gib: float
    mixed_precision: str = "fp32"
    active_params: int = 0
    ac_mode: str = "none"
    mem_transient_gib: float = 0.0
    device_memory_gib: float | None = None
    memory_headroom: float = 0.0  # fraction of device memory kept free (cluster.memory_headroom)
    usable_memory_gib: float | None = None  # what the peak may use: device memory less the headroom
    tflops_per_rank_at_mfu40: float = 0.0
    step_time_s_at_mfu40: float | None = None
    expert_parallel: int = 1
    alltoall_gib_per_step: float = 0.0
    unit: str = "token"  # what the objective counts (token, image)
    flops_per_unit: float = 0.0
    units_per_step: int = 0
    tokens_per_sample: int = 0
    # a batch / seq-len schedule's stages: every figure above is its largest step's (the most
    # micro-batches, the longest windows; activations are one micro-batch's, whatever the count)
    schedule: str = ""
    # the peak before the CUDA caching allocator's reserve (what the tensors hold: the figure a
    # simulation's counted bytes compare with); equal to mem_total_gib off CUDA
    mem_allocated_gib: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def fits(self) -> bool:
        """The estimated peak is within the usable memory (always on CPU: no limit)."""
        return self.usable_memory_gib is None or self.mem_total_gib <= self.usable_memory_gib

    def format(self) -> str:
        fits = ""
        if self.usable_memory_gib is not None:
            fits = " (fits)" if self.fits else f" (exceeds the {self.usable_memory_gib:.1f} GiB usable)"
        rows = [
            ("model", self.flavor),
            ("parameters", f"{self.params:,} ({self.params / 1e9:.3f}B)"),
            ("non-embedding parameters", f"{self.non_embedding_params:,}"),
            *([("active parameters per token", f"{self.active_params:,}")]
              if self.active_params and self.active_params != self.params else []),
            *([("FLOPs per token", f"{self.flops_per_token:.4g}"
               + (" (active parameters + attention)" if self.active_params and self.active_params != self.params else ""))]
              if self.unit == "token" else
              [(f"FLOPs per {self.unit}", f"{self.flops_per_unit:.4g} ({self.tokens_per_sample:,} tokens each)"),
               (f"{self.unit}s per step (global)", f"{self.units_per_step:,}")]),
            ("tokens per step (global)", f"{self.tokens_per_step:,}"),
            ("FLOPs per step (global)", f"{self.flops_per_step:.4g}"),
            ("world size / layout", f"{self.world_size} / {self.layout}"),
            ("precision / activation ckpt", f"{self.mixed_precision} / {self.ac_mode}"),
            ("gradient accumulation", str(self.grad_accum_steps)),
            *([("schedule (sized for its largest step)", self.schedule)] if self.schedule else []),
            ("memory per rank: params", f"{self.mem_params_gib:.3f} GiB"),
            ("memory per rank: grads", f"{self.mem_grads_gib:.3f} GiB"),
            ("memory per rank: optimizer", f"{self.mem_optimizer_gib:.3f} GiB"),
            ("memory per rank: activations", f"{self.mem_activations_gib:.3f} GiB"),
            ("memory per rank: transient", f"{self.mem_transient_gib:.3f} GiB"),
            ("memory per rank: peak", f"{self.mem_total_gib:.3f} GiB{fits}"),
        ]
        if self.usable_memory_gib is not None:
            rows.append(("device memory / headroom", f"{self.device_memory_gib:.0f} GiB / {self.memory_headroom:.0%} "
                         f"kept free -> {self.usable_memory_gib:.1f} GiB usable"))
        if self.expert_parallel > 1:
            rows.append(("expert all-to-all per rank", f"{self.alltoall_gib_per_step:.3g} GiB/step"))
        if self.step_time_s_at_mfu40 is not None:
            rows.append((f"step time at {ASSUMED_MFU:.0%} MFU", f"{self.step_time_s_at_mfu40:.3g} s"))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def plan(spec: RunSpec, runtime: Runtime = TITAN_HYDRA) -> Plan:
    """Parameters, FLOPs and per-rank peak memory of the run ``spec`` describes, without allocating.

    Peak = fp32 params + AdamW state (8 B/param) + max(saved activations at the start of
    backward, full gradients + optimizer-step temporaries), each divided by how the layout splits
    it: FSDP shards params/grads/state over dp_shard*cp, TP splits weights and heads, PP keeps
    one stage (with the pipeline's in-flight microbatches), CP splits the sequence. FSDP adds the
    unsharded parameters/gradients of the groups being computed (the output group and last block
    at the start of backward), and a third candidate peak at the end of backward (sharded grads
    + one unsharded group being reduce-scattered).
    """
    dims, family, margs, args, cluster = spec.dims, spec.family, spec.model_args, spec.shape, spec.cluster
    mp, seq_len = spec.mixed_precision, spec.batch.seq_len
    if isinstance(family, SizesSamples):  # positions and FLOPs per sample
        seq = family.sample_tokens(margs, spec.data, seq_len)
        per_sample = family.flops_per_sample(margs, spec.data, seq_len)
    else:
        seq, per_sample = seq_len, family.flops_per_token(margs, seq_len) * seq_len
    fpt = per_sample / seq
    global_bs, accum = spec.batch.global_, spec.batch.grad_accum
    tokens = global_bs * seq
    mem = rank_memory(spec, runtime, seq)
    ep = int(getattr(dims, "ep", 1))
    a2a = alltoall_bytes(args, precision_kind(mp, dims.fsdp_enabled), spec.batch.local * seq / dims.cp * accum,
                         math.ceil(args.moe_layers / dims.pp), ep)
    peak_tflops = peak_tflops_of(cluster)
    flops_rank = fpt * tokens / dims.world_size
    step_time = flops_rank / (ASSUMED_MFU * peak_tflops * 1e12) if peak_tflops else None
    per_unit = family.objective.unit == "token"
    device_gib = device_memory_of(cluster)
    return Plan(
        flavor=spec.flavor, params=args.params,
        active_params=args.active_params, non_embedding_params=args.params - args.embedding_params,
        flops_per_token=fpt, tokens_per_step=tokens, flops_per_step=fpt * tokens, world_size=dims.world_size,
        layout=layout_label(dims, ep), grad_accum_steps=accum, mem_params_gib=mem.params / GIB,
        mem_grads_gib=mem.grads / GIB, mem_optimizer_gib=mem.optimizer / GIB,
        mem_activations_gib=mem.activations / GIB, mem_total_gib=mem.peak / GIB,
        mixed_precision=mp, ac_mode=spec.activation_checkpoint.mode, mem_transient_gib=mem.transient / GIB,
        device_memory_gib=device_gib, memory_headroom=float(cluster.memory_headroom),
        usable_memory_gib=usable_memory_of(cluster),
        tflops_per_rank_at_mfu40=ASSUMED_MFU * peak_tflops if peak_tflops else 0.0, step_time_s_at_mfu40=step_time,
        expert_parallel=ep, alltoall_gib_per_step=a2a / GIB, unit=family.objective.unit,
        flops_per_unit=fpt if per_unit else per_sample, units_per_step=tokens if per_unit else global_bs,
        tokens_per_sample=seq,
        schedule=spec.batch.schedule.describe() if spec.batch.schedule is not None else "",
        mem_allocated_gib=mem.allocated / GIB,
    )


def layout_label(dims, ep: int) -> str:
    layout = f"dp_replicate={dims.dp_replicate} dp_shard={dims.dp_shard} tp={dims.tp} pp={dims.pp} cp={dims.cp}"
    return layout + f" ep={ep}" if ep > 1 else layout


@dataclass(frozen=True)
class RankMemory:
    """Bytes on one rank: the static fp32 state, what backward adds, and the step's peak."""

    params: float
    grads: float
    optimizer: float
    activations: float
    transient: float
    peak: float
    allocated: float  # the peak before the CUDA allocator's reserve (= peak off CUDA)


def rank_memory(spec: RunSpec, runtime: Runtime, seq: int) -> RankMemory:
    """Per-rank memory of a step (``plan``'s docstring) for ``seq`` positions per sample."""
    dims, args, mp = spec.dims, spec.shape, spec.mixed_precision
    ac = spec.activation_checkpoint
    fsdp_shard = dims.dp_shard * dims.cp if dims.fsdp_enabled else 1
    params_local = stage_params(args, dims.pp) / dims.tp / fsdp_shard + expert_shard_padding(args, dims)
    mem_params = params_local * 4  # fp32 master weights
    mem_grads = params_local * 4 + tp_partial_embedding_grad_bytes(args, dims)
    mem_optim = params_local * 8  # AdamW exp_avg + exp_avg_sq
    kind = precision_kind(mp, dims.fsdp_enabled)
    local_tokens = in_flight_tokens(spec.batch.local, seq, dims)
    act = saved_activation_bytes(spec, kind, local_tokens, params_local)
    transient, end_of_backward = fsdp_unsharded_bytes(args, dims, kind, mem_grads)
    optimizer_step = optimizer_step_bytes(spec, params_local, mem_grads, fsdp_shard)
    if spec.cluster.device == "cuda" and kind == "bf16_params":
        # CUDA: what the run holds (cuda_dynamic_peak) times the caching allocator's reserve.
        dyn, unsharded = cuda_dynamic_peak(spec, runtime, seq_len=seq)
        dyn += math.ceil(args.moe_layers / dims.pp) * moe_activation_bytes(args, kind, ac.mode, local_tokens)
        dyn += math.ceil(args.linear_layers / dims.pp) * linear_attention_bytes(args, kind, ac.mode, local_tokens,
                                                                                dims.tp)
        act, transient = dyn - unsharded, unsharded
        compiled = spec.compiler.enabled
        reserve = ALLOCATOR_RESERVE_COMPILED if compiled else ALLOCATOR_RESERVE_EAGER
        allocated = mem_params + mem_optim + max(dyn, optimizer_step, end_of_backward)
        peak = mem_params + mem_optim + reserve * max(dyn, optimizer_step, end_of_backward)
    else:
        peak = allocated = mem_params + mem_optim + max(act + transient, optimizer_step, end_of_backward)
    return RankMemory(mem_params, mem_grads, mem_optim, act, transient, peak, allocated)


def in_flight_tokens(local_batch_size: int, seq: int, dims) -> float:
    """Tokens whose activations a rank holds at once: its CP share of the local batch; under PP
    the microbatches in flight on the first stage (up to pp of them)."""
    local_tokens = local_batch_size * seq / dims.cp
    if dims.pp > 1:
        micro = dims.pp_microbatches or dims.pp
        local_tokens = local_tokens / micro * min(micro, dims.pp)
    return local_tokens


def saved_activation_bytes(spec: RunSpec, kind: str, local_tokens: float, params_local: float) -> float:
    """Activations saved for backward on one rank (the measured CPU coefficients)."""
    dims, args = spec.dims, spec.shape
    ac = spec.activation_checkpoint
    layers = math.ceil(args.n_layers / dims.pp)
    act = activation_bytes(args, kind, ac.mode, local_tokens, layers, ac.freq, dims.tp, ac.policy)
    act += math.ceil(args.moe_layers / dims.pp) * moe_activation_bytes(args, kind, ac.mode, local_tokens)
    act += math.ceil(args.linear_layers / dims.pp) * linear_attention_bytes(args, kind, ac.mode, local_tokens,
                                                                            dims.tp)
    act += head_activation_bytes(args, local_tokens, dims, kind)
    act += fp32_attention_bytes(spec, local_tokens, layers)
    if kind == "bf16":  # autocast's bf16 copies of the weights live until backward ends
        act += params_local * 2
    return act


def fsdp_unsharded_bytes(args: ModelShape, dims, kind: str, mem_grads: float) -> tuple[float, float]:
    """(unsharded params + grads of the groups in use at the start of backward, the end-of-backward
    peak): both 0 without FSDP."""
    if not dims.fsdp_enabled:
        return 0.0, 0.0
    block = largest_block_params(args, int(getattr(dims, "ep", 1))) / dims.tp
    head = args.head_params / dims.tp
    pbytes = 2 if kind == "bf16_params" else 4
    transient = (head + block) * (pbytes + 4)  # unsharded params + their unsharded grads
    # Last groups of backward: (almost) every sharded gradient already exists while a group
    # is still unsharded: its params, its unsharded grads and reduce-scatter's fp32 copy-in.
    # This is the peak when parameters outweigh activations (the ~100M model at 128 tokens).
    end_of_backward = mem_grads + max(head, block) * (2 * pbytes + 4)
    if dims.tp > 1:
        end_of_backward = max(end_of_backward, tp_embedding_backward_bytes(args, dims, pbytes, block, mem_grads))
    return transient, end_of_backward


def tp_embedding_backward_bytes(args: ModelShape, dims, pbytes: int, block: float, mem_grads: float) -> float:
    """The embedding's backward under TP, the last of the step: DTensor's strategy for
    ``embedding_dense_backward`` with a row-wise (vocabulary-sharded) table makes a Partial
    gradient of the WHOLE table on every rank before it is reduce-scattered, while the sharded
    gradients exist, the root group (embedding, head) is unsharded and the last block's fp32
    reduce-scatter input is still in flight. Simulated on llama3_70b at fsdp 8 x tp 8: these
    terms sum to the measured end-of-backward peak (3.07 GiB above parameters and AdamW state)."""
    root = (args.embedding_params + args.head_params) / dims.tp
    return mem_grads + args.embedding_params * pbytes + root * pbytes + block * 4


def tp_partial_embedding_grad_bytes(args: ModelShape, dims) -> float:
    """Without FSDP, TP's row-wise embedding keeps the Partial gradient its backward makes (the
    WHOLE table, see ``tp_embedding_backward_bytes``) as its ``.grad`` until the step: fp32 on
    every rank, the vocabulary the shard leaves out on top of the shard counted with the others.
    Simulated on llama3_8b at tp 8: 2.40 GiB of gradients against 0.69 of shards; the difference
    is this term (1.71 GiB). Under PP the first stage holds it; the planner's one stage takes it."""
    if dims.tp == 1 or dims.fsdp_enabled:
        return 0.0
    return args.embedding_params * 4 * (1 - 1 / dims.tp)


def optimizer_step_bytes(spec: RunSpec, params_local: float, mem_grads: float, fsdp_shard: int) -> float:
    """Gradients + AdamW's temporaries. On CUDA AdamW is foreach (a temporary as large as all
    local params); on CPU it loops per tensor (as large as the largest one: embedding/output or an
    FFN weight)."""
    args, dims = spec.shape, spec.dims
    expert_tensor = args.expert_params / max(3 * args.moe_layers, 1)  # one of w1/w2/w3 of a layer
    largest = max(args.embedding_params, args.dim * args.ffn_dim, expert_tensor) / dims.tp / fsdp_shard
    return mem_grads + 4 * (params_local if spec.cluster.device == "cuda" else largest)
