"""Analytic plan of a run: parameters, FLOPs and per-rank memory, without allocating.

Used by ``dry_run=true`` and ``recipes/estimate.py``. Per-rank peak memory = parameters +
AdamW state + the larger of (activations saved for backward, gradients + optimizer temporaries),
split by the layout (FSDP shards, TP splits, PP stages, CP sequence chunks), by mixed precision
and by activation-checkpoint mode. The per-block activation coefficients were measured on this
model code with torch's MemTracker; tests/test_estimator.py checks the total against the
tensor-level peak of real training steps (the CPU analogue of torch.cuda.max_memory_allocated).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from omegaconf import DictConfig, OmegaConf

from titan_hydra.config import mixed_precision_of

from titan_hydra.models.protocol import ModelShape
from titan_hydra.models.registry import args_of
from titan_hydra.train.attention_kernel import auto_picks_kernel
from titan_hydra.train.precision import attention_dtype

GIB = 1024**3


def model_shape(cfg: DictConfig) -> ModelShape:
    """The family-independent shape numbers of ``cfg.model`` (no model is allocated)."""
    family, args = args_of(cfg.model)
    return family.shape(args)


# Bytes saved for backward per token and per transformer block, measured with torch's
# dispatch-level MemTracker on this model code (eager; SDPA saves q/k/v after rope, with GQA's
# k/v already repeated to n_heads, plus a logsumexp per head) and written as d (dim), kv (kv
# dim), f (FFN hidden) coefficients. "bf16" = fp32 params under bf16 autocast (norms and the
# residual stream stay fp32, each Linear casts its input); "bf16_params" = FSDP's bf16 params.
ACT_COEF = {
    # (d, kv, f) bytes per element; mode none = everything saved
    ("fp32", "none"): (40, 0, 16),
    ("bf16", "none"): (44, 6, 8),
    ("bf16_params", "none"): (28, 0, 8),
    # selective_op: matmul and attention outputs saved, norms/rope/SiLU recomputed
    ("fp32", "selective_op"): (20, 8, 8),
    ("bf16", "selective_op"): (26, 6, 4),
    ("bf16_params", "selective_op"): (14, 4, 4),
}
# Attention wider than the residual stream (Qwen3: n_heads x head_dim > dim): bytes per token,
# block and element of (q_dim - dim) for the q-wide tensors SDPA and wo keep (q, repeated k/v,
# output). Per-head QK-norm (Qwen3): bytes per element of (q_dim + kv_dim) plus an fp32 rstd per
# head; selective_op recomputes the norms. Measured with MemTracker on qwen3_debug variants
# (head_dim 32 vs 64, qk_norm on/off; the bf16 ones net of autocast's larger weight copies).
Q_WIDE_COEF = {("fp32", "none"): 16, ("bf16", "none"): 6, ("bf16_params", "none"): 6,
               ("fp32", "selective_op"): 8, ("bf16", "selective_op"): 1, ("bf16_params", "selective_op"): 1}
QK_NORM_COEF = {("fp32", "none"): 8, ("bf16", "none"): 6, ("bf16_params", "none"): 6}
RESIDUAL_BYTES = {"fp32": 4, "bf16": 4, "bf16_params": 2}
# selective_op_policy=every_second_mm recomputes wk, wo and w3 (kv, d and f wide per token) whose
# outputs all_mm keeps: bytes per element of a matmul output.
MM_OUT_BYTES = {"fp32": 4, "bf16": 2, "bf16_params": 2}
# Extra bytes per token and block (x dim) when bf16 training runs SDPA in fp32
# (training.attention_precision; auto does on CPU below head_dim 32): the fp32 copies of q/k/v
# and the fp32 output that SDPA saves. Measured like ACT_COEF: +10 d saved for backward
# without AC, +2 d under selective_op (debug model, MemTracker).
ATTN_FP32_EXTRA = {"none": 10, "selective_op": 2}


def precision_kind(mp: str, fsdp: bool) -> str:
    if mp != "bf16":
        return "fp32"
    return "bf16_params" if fsdp else "bf16"


def block_activation_bytes(args: ModelShape, kind: str, mode: str, tokens: float, tp: int = 1,
                           policy: str = "all_mm") -> float:
    """Saved activations of one block for ``tokens`` tokens (per rank: heads split by tp)."""
    d, kv, f = args.dim, args.kv_dim, args.ffn_dim
    if mode == "full":
        return tokens * RESIDUAL_BYTES[kind] * d / tp  # only the block input
    cd, ckv, cf = ACT_COEF[(kind, mode)]
    per_token = cd * d + ckv * kv + cf * f + 4 * args.n_heads
    if mode == "selective_op" and policy == "every_second_mm":
        per_token -= MM_OUT_BYTES[kind] * (d + kv + f)
    per_token += Q_WIDE_COEF[(kind, mode)] * max(args.q_dim - d, 0)
    if args.qk_norm and (kind, mode) in QK_NORM_COEF:
        per_token += QK_NORM_COEF[(kind, mode)] * (args.q_dim + kv) + 4 * (args.n_heads + args.n_kv_heads)
    return tokens * per_token / tp


def activation_bytes(args: ModelShape, kind: str, mode: str, tokens: float, layers: float,
                     freq: int, tp: int = 1, policy: str = "all_mm") -> float:
    """All blocks' saved activations plus one block's recompute (transient) under AC."""
    full = block_activation_bytes(args, kind, "none", tokens, tp)
    if mode == "none":
        return layers * full
    if mode == "selective_layer":
        ckpt = math.ceil(layers / max(freq, 1))
        return ckpt * block_activation_bytes(args, kind, "full", tokens, tp) + (layers - ckpt) * full
    saved = block_activation_bytes(args, kind, mode, tokens, tp, policy)
    if mode == "selective_op":  # the recomputed norms/rope are small next to the head's gradients
        return layers * saved
    return layers * saved + (full - saved)  # full: one block rebuilt at a time


def small_head_kernel_applies(cfg: DictConfig, args: ModelShape, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether ``training.attention_kernel`` would install the small-head kernel (its policy's
    static conditions: CPU, 16-wide heads, no context parallel, not forced to SDPA; under auto,
    also this CPU's measurement of the kernel against SDPA)."""
    from titan_hydra.kernels.small_head_attention import HEAD_DIM

    choice = str(OmegaConf.select(cfg, "training.attention_kernel", default="auto"))
    cp = int(OmegaConf.select(cfg, "parallelism.cp", default=1) or 1)
    if choice == "sdpa" or str(cfg.cluster.device) != "cpu" or args.head_dim != HEAD_DIM or cp != 1:
        return False
    return choice == "small_head" or auto_picks_kernel(args.n_heads, int(cfg.training.seq_len), dtype)


def fp32_attention_bytes(cfg: DictConfig, args: ModelShape, mp: str, ac: DictConfig, tokens: float,
                         layers: int, tp: int) -> float:
    """What upcast attention adds to the saved activations (0 unless it is in effect).

    The small-head CPU kernel (train/attention_kernel.py) replaces the upcast where it applies:
    it widens bf16 q/k/v inside and saves only them, the output and an fp32 logsumexp, as SDPA."""
    mode = str(cfg.training.attention_precision)
    seq_len = int(cfg.training.seq_len)
    if mp != "bf16" or attention_dtype(mode, mp, cfg.cluster.device, args.head_dim, seq_len) is None:
        return 0.0
    if small_head_kernel_applies(cfg, args, torch.float32):  # the upcast SDPA it would replace
        return 0.0
    per_block = tokens * args.dim / tp
    if ac.mode in ATTN_FP32_EXTRA:  # none / selective_op: every block keeps its copies
        return layers * per_block * ATTN_FP32_EXTRA[ac.mode]
    if ac.mode == "selective_layer":
        plain = layers - math.ceil(layers / max(int(ac.selective_layer_freq), 1))
        return max(plain, 1) * per_block * ATTN_FP32_EXTRA["none"]
    return per_block * ATTN_FP32_EXTRA["none"]  # full: the one block being recomputed


# Mixture-of-Experts layers save more than their active FFN width (already in ``ffn_dim``): the
# token copies routed to each of the top_k experts (gathered input, expert output, gate-weighted
# output: bytes per element of top_k x dim) and the router's fp32 logits and scores per expert;
# selective_op recomputes most of the copies. Fitted with MemTracker on qwen3_moe_debug and
# deepseek_v3_debug (estimate/measured 0.98-1.13, 2026-11-23; tests/test_estimator.py).
MOE_ROUTED_COEF = {("fp32", "none"): 12, ("bf16", "none"): 10, ("bf16_params", "none"): 8,
                   ("fp32", "selective_op"): 6, ("bf16", "selective_op"): 2, ("bf16_params", "selective_op"): 2}
MOE_ROUTER_BYTES = 12  # per token and expert: fp32 logits, scores, selection mask


def moe_activation_bytes(args: ModelShape, kind: str, mode: str, tokens: float) -> float:
    """Extra saved activations of one MoE layer (0 under full AC: only the block input is kept)."""
    if not args.n_experts or mode == "full":
        return 0.0
    coef = MOE_ROUTED_COEF[(kind, "selective_op" if mode == "selective_op" else "none")]
    per_token = coef * args.top_k * args.dim + MOE_ROUTER_BYTES * args.n_experts
    return tokens * per_token


def alltoall_bytes(args: ModelShape, kind: str, tokens: float, moe_layers: float, ep: int) -> float:
    """Bytes one rank sends per step through expert parallelism's all-to-all: each MoE layer
    dispatches and combines top_k copies of every token, forward and backward (4 passes); the
    share that stays on the rank ((ep-1)/ep leaves it) is free."""
    if ep <= 1 or not args.n_experts:
        return 0.0
    elem = 4 if kind == "fp32" else 2
    return 4 * moe_layers * args.top_k * tokens * args.dim * elem * (ep - 1) / ep


# ---------------------------------------------------------------------------------------------
# CUDA model. On a GPU the peak that matters is the caching allocator's reserved memory (what
# torchtitan logs and what an OOM is measured against); the terms below are derived from what the
# code holds, op by op, and checked against torchtitan's published H100 runs
# (tests/test_estimator_published.py, tests/data/torchtitan_h100_202412.yaml).
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Runtime:
    """Behaviours of the training code that decide memory but are not config keys.

    (What ``activation_checkpoint=selective_op`` saves is a config key,
    ``activation_checkpoint.selective_op_policy``; torchtitan's December 2024 runs saved every
    second matmul, which titan_hydra offers as ``every_second_mm``. Both drop the bf16 logits
    before backward.)
    ``pp_split``: which stages get the extra layers when n_layers % stages != 0: ``front``
    (titan_hydra's parallel/pp.py) or ``middle`` (torchtitan's generate_split_points: the first and
    last stages get one fewer).
    ``pp_keeps_outputs``: torch's pipeline schedule keeps the last stage's output of every
    microbatch (the logits) until the step ends unless ``step(return_outputs=False)``;
    torchtitan's December 2024 train loop kept them, titan_hydra's runner drops them.
    """

    name: str
    pp_split: str = "front"
    pp_keeps_outputs: bool = False


TITAN_HYDRA = Runtime("titan_hydra")
TORCHTITAN_2024_12 = Runtime("torchtitan@9dec370", pp_split="middle", pp_keeps_outputs=True)

# Reserved / allocated memory of the CUDA caching allocator at the peak. Blocks freed in one size
# class are not reusable by a larger request, so the reserved pool exceeds the live tensors.
# Compiled blocks allocate a few fixed-size fused buffers; eager blocks also allocate and free
# RMSNorm's fp32 upcasts and RoPE's fp32 complex copies (2-4x a bf16 activation) in every forward
# and recompute, which splits cached segments further. One constant for each, calibrated on the
# published ratio of eager to compiled 8B runs (82.4/77.0 = 1.07 and 67.0/62.0 = 1.08) and on
# the usual 5-10% fragmentation of compiled steady-state training; not fitted per row.
ALLOCATOR_RESERVE_COMPILED = 1.08
ALLOCATOR_RESERVE_EAGER = 1.155

# Loss backward, per logit element: the fp32 log-softmax output kept for backward, its incoming
# gradient and the gradient it produces (4 B each, alive together inside log_softmax_backward).
LOSS_BACKWARD_BYTES_PER_LOGIT = 12
# Under tensor-parallel loss parallel, torch's DTensor handler fuses nll and log-softmax backward
# as ``(zeros_like(x) with -1 at the targets + exp(x)) * grad``: the saved fp32 log-probs x plus
# three fp32 temporaries of its size alive together (16 B per local logit; measured with
# MemTracker on 2 gloo ranks: 16.0, against 12.0 for the plain loss).
LOSS_PARALLEL_BACKWARD_BYTES_PER_LOGIT = 16


def loss_bytes_per_token(args: ModelShape, dims) -> float:
    """Bytes per token of the loss backward's logit-sized buffers on this rank: vocab-sharded under
    loss parallel, the whole vocabulary otherwise (TP without loss parallel gathers the logits)."""
    if dims.loss_parallel_enabled:
        return LOSS_PARALLEL_BACKWARD_BYTES_PER_LOGIT * args.vocab_size / dims.tp
    return LOSS_BACKWARD_BYTES_PER_LOGIT * args.vocab_size


def sac_saved_bytes_per_token(args: ModelShape, policy: str, tp: int) -> float:
    """Bytes one block keeps per token under selective op AC on CUDA (bf16 activations).

    Always: the block input (the checkpoint's argument, 2d) and the attention output (2d) plus its
    fp32 logsumexp per head. ``all_mm`` adds all seven matmul outputs (wq, wo, w2: 2d each; wk, wv:
    2kv each; w1, w3: 2f each); ``every_second_mm`` adds wq (2d), wv (2kv), w1 (2f), w2 (2d).
    Head-parallel parts are split by tp (the residual stream too, under sequence parallel).
    """
    d, kv, f = args.dim, args.kv_dim, args.ffn_dim
    base = 2 * d + 2 * d + 4 * args.n_heads
    if policy == "every_second_mm":
        mm = 2 * d + 2 * kv + 2 * f + 2 * d
    elif policy == "all_mm":
        mm = 3 * 2 * d + 2 * 2 * kv + 2 * 2 * f
    else:
        raise ValueError(f"unknown selective AC policy {policy!r}")
    return (base + mm) / tp


# One block's forward intermediates while it is recomputed in backward (bytes per token, x dim /
# x ffn): eager = ACT_COEF's measured bf16_params/none (28 d + 8 f: RMSNorm and RoPE fp32
# copies, q/k/v, SiLU and product); compiled = the fused kernels' bf16 outputs only (norm outputs,
# q/k/v, attention output, residual: ~12 d; w1, w3 and the SiLU product: 6 f).
RECOMPUTE_COEF = {"eager": (28, 8), "compiled": (12, 6)}


def recompute_bytes(args: ModelShape, tokens: float, tp: int, compiled: bool) -> float:
    """Transient of rebuilding one block in backward under AC (full or selective), for ``tokens``.
    Under sequence parallel the two all-gathered norm outputs (2d each) are full-sequence."""
    cd, cf = RECOMPUTE_COEF["compiled" if compiled else "eager"]
    per_token = (cd * args.dim + cf * args.ffn_dim) / tp
    if tp > 1:
        per_token += 2 * 2 * args.dim * (tp - 1) / tp
    return tokens * per_token


def loss_peak_bytes(args: ModelShape, tokens: float, dims) -> float:
    """The loss backward's peak for ``tokens`` (logits vocab-sharded by tp under loss parallel):
    fp32 log-softmax saved + its two gradients (the bf16 logits are dropped before backward), and
    the final norm's output the output projection saved (all-gathered: 2d per token)."""
    return tokens * (loss_bytes_per_token(args, dims) + 2 * args.dim)


def saved_block_bytes_cuda(args: ModelShape, mode: str, tokens: float, tp: int, policy: str) -> float:
    """What one block keeps for backward on CUDA for ``tokens`` (bf16 activations, FSDP bf16 params)."""
    if mode == "full":
        return tokens * 2 * args.dim / tp  # the block input (sequence-sharded under SP)
    if mode == "selective_op":
        return tokens * sac_saved_bytes_per_token(args, policy, tp)
    return block_activation_bytes(args, "bf16_params", "none", tokens, tp)


def stage_layer_counts(dims, n_layers: int, runtime: Runtime) -> list[int]:
    """Layers of every pipeline stage, in stage order (titan_hydra's split or torchtitan's)."""
    from titan_hydra.parallel.pp import default_stages_per_rank, stage_layer_ranges

    if runtime.pp_split == "front" or dims.pp_split_points or dims.pp_layers_per_stage:
        return [len(r) for r in stage_layer_ranges(dims, n_layers)]
    n_stages = dims.pp * default_stages_per_rank(dims.pp_schedule)
    base, extra = divmod(n_layers, n_stages)  # torchtitan: first stage base, middle ones +1 first
    sizes = [base] + [base + (1 if s <= extra else 0) for s in range(1, n_stages - 1)]
    return sizes + [n_layers - sum(sizes)] if n_stages > 1 else [n_layers]


def pipeline_order(schedule: str, pp: int, rank: int, n_mb: int, n_local: int) -> list[tuple[str, int]]:
    """(F|B, local stage) in the order a rank runs them, as torch.distributed.pipelining does.

    1F1B: ``min(n_mb, pp - rank)`` warmup forwards, then backward-then-forward pairs, then the
    remaining backwards (the first stage holds up to pp microbatches). Interleaved 1F1B (and the
    other multi-stage schedules, approximated by it): ``(n_local - 1) * per_round + 2 * (pp - 1 -
    rank)`` warmup forwards (capped at all of them; torch's ``_get_warmup_ops``), then
    forward-then-backward pairs; forwards walk the local stages in rounds of ``per_round``
    microbatches, backwards walk them in reverse. GPipe: all forwards, then all backwards.
    """
    if n_local == 1:
        warm = n_mb if schedule == "GPipe" else min(n_mb, pp - rank)
        ops = [("F", 0)] * warm
        for _ in range(n_mb - warm):
            ops += [("B", 0), ("F", 0)]
        return ops + [("B", 0)] * warm
    total = n_mb * n_local
    per_round = n_mb // max(1, n_mb // pp)
    warm = min((n_local - 1) * per_round + 2 * (pp - 1 - rank), total)
    fwd = [("F", (i // per_round) % n_local) for i in range(total)]
    bwd = [("B", n_local - 1 - (i // per_round) % n_local) for i in range(total)]
    ops = fwd[:warm]
    for i in range(total - warm):
        ops += [fwd[warm + i], bwd[i]]
    return ops + bwd[total - warm:]


def cuda_dynamic_peak(cfg: DictConfig, dims, args: ModelShape, runtime: Runtime,
                      pp_rank: int | None = None) -> tuple[float, float]:
    """(peak bytes above the sharded fp32 state, unsharded parameter bytes within it) on the
    worst rank (or on pipeline rank ``pp_rank``), on CUDA with bf16 FSDP params.

    Without PP: the saved activations of every block, plus the larger of the loss backward's
    peak and one block's recompute with its unsharded gradients (bf16, + fp32 reduce-scatter input);
    FSDP keeps the root (embedding, output) and the last block unsharded through it.
    With PP (FSDP does not reshard after forward and does not reduce-scatter until the last
    microbatch, as torchtitan and titan_hydra do): the whole stage's parameters stay unsharded, and
    after a stage's first backward its gradients accumulate unsharded in fp32 (FSDP2's
    reduce_dtype); the schedule (``pipeline_order``) decides how many microbatches' activations
    are alive at each moment; the worst moment of the worst rank counts.
    """
    t, ac = cfg.training, cfg.activation_checkpoint
    tp = dims.tp
    compiled = str(OmegaConf.select(cfg, "compile.mode", default="none")) != "none"
    f8 = OmegaConf.select(cfg, "float8", default=None)
    fp8_gather = bool(f8 is not None and str(f8.recipe) != "none" and f8.enable_fsdp_float8_all_gather)
    # One block as FSDP unshards it: for MoE the largest (a MoE block with its 1/ep of the routed
    # experts); per layer on average for what a pipeline stage holds unsharded.
    ep = int(getattr(dims, "ep", 1))
    blk = largest_block_params(args, ep)
    avg_blk = args.block_params - (args.expert_params / args.n_layers) * (1 - 1 / max(ep, 1)) \
        if args.moe_layers else args.block_params
    # Unsharded block weights: the Linear weights travel (and stay) as float8 under fp8 all-gather.
    w_bytes = 1 if fp8_gather and dims.fsdp_enabled else 2
    block_w = blk / tp * w_bytes
    if not dims.fsdp_enabled:
        block_w = 0.0  # the local params are already whole; counted in the static state
    root_w = (args.embedding_params + args.head_params) / tp * 2 if dims.fsdp_enabled else 0.0
    block_grad = blk / tp * (2 + 4)  # bf16 unsharded grads + fp32 reduce-scatter input
    mode = str(ac.mode)
    policy = str(ac.get("selective_op_policy", "all_mm"))
    if mode == "selective_layer":
        mode = "none"  # not modeled separately on CUDA: the upper bound
    if dims.pp == 1:
        tokens = t.local_batch_size * t.seq_len / dims.cp
        saved = args.n_layers * saved_block_bytes_cuda(args, mode, tokens, tp, policy)
        rebuild = recompute_bytes(args, tokens, tp, compiled) if mode != "none" else 0.0
        dyn = saved + max(loss_peak_bytes(args, tokens, dims), rebuild + block_grad)
        unsharded = root_w + 2 * block_w  # root + the last block (kept) + the one in use
        return dyn + unsharded, unsharded
    n_mb = int(dims.pp_microbatches or dims.pp)
    mb_tokens = t.local_batch_size * t.seq_len / dims.cp / n_mb
    sizes = stage_layer_counts(dims, args.n_layers, runtime)
    n_local = len(sizes) // dims.pp
    per_block = saved_block_bytes_cuda(args, mode, mb_tokens, tp, policy)
    rebuild = recompute_bytes(args, mb_tokens, tp, compiled) if mode != "none" else 0.0
    # torch.distributed.pipelining's buffers (stage.py): a stage that receives activations has a
    # recv buffer per microbatch, one that receives gradients a grad buffer per microbatch, both
    # allocated once and kept; fwd_cache keeps each in-flight microbatch's stage output until its
    # backward. Stage I/O is the residual stream, sequence-sharded under TP's sequence parallel;
    # the last stage's output is its logits (vocab-sharded under loss parallel). A received input
    # is also the first block's saved input (counted in per_block), hence ``io`` is taken back.
    io = mb_tokens * 2 * args.dim / (tp if dims.tp_sequence_parallel else 1)
    logits_out = mb_tokens * 2 * args.vocab_size / (tp if dims.loss_parallel_enabled else 1)
    worst = (0.0, 0.0)
    for rank in range(dims.pp) if pp_rank is None else [pp_rank]:
        stages = [rank + k * dims.pp for k in range(n_local)]
        last = len(sizes) - 1
        p2p = sum(n_mb * io * ((s != 0) + (s != last)) for s in stages)
        unsharded = sum(sizes[s] * avg_blk / tp * w_bytes for s in stages) if dims.fsdp_enabled else 0.0
        unsharded += (args.embedding_params / tp * 2 if 0 in stages and dims.fsdp_enabled else 0.0)
        unsharded += (args.head_params / tp * 2 if last in stages and dims.fsdp_enabled else 0.0)
        live = [0] * n_local
        done = [0] * n_local  # microbatches whose backward has run, per local stage
        peak = 0.0
        for op, k in pipeline_order(str(dims.pp_schedule), dims.pp, rank, n_mb, n_local):
            if op == "F":
                live[k] += 1
                continue
            held = sum(n * (sizes[s] * per_block + (logits_out if s == last else io) - (io if s else 0))
                       for n, s in zip(live, stages)) + p2p
            if runtime.pp_keeps_outputs and last in stages:  # outputs kept past their backward
                held += done[stages.index(last)] * logits_out
            grads_done = [d > 0 and n_mb > 1 for d in done]
            acc = sum(sizes[s] * avg_blk / tp * 4 for g, s in zip(grads_done, stages) if g)
            extra = rebuild + block_grad
            if stages[k] == last:
                extra = max(extra, loss_peak_bytes(args, mb_tokens, dims))
            peak = max(peak, held + acc + extra)
            live[k] -= 1
            done[k] += 1
        if peak + unsharded > sum(worst):
            worst = (peak, unsharded)
    return worst[0] + worst[1], worst[1]


def head_activation_bytes(args: ModelShape, tokens: float, dims) -> float:
    """Final norm + logits at the loss backward: the fp32 log-softmax kept for backward, its
    gradient and the logits' gradient (12 B/vocab; the logits themselves are dropped before
    backward, parallel/runner.py)."""
    return tokens * (12 * args.dim + loss_bytes_per_token(args, dims))


@dataclass
class Plan:
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
    tflops_per_rank_at_mfu40: float = 0.0
    step_time_s_at_mfu40: float | None = None
    expert_parallel: int = 1
    alltoall_gib_per_step: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)

    def format(self) -> str:
        fits = ""
        if self.device_memory_gib:
            fits = " (fits)" if self.mem_total_gib <= self.device_memory_gib else f" (exceeds {self.device_memory_gib:.0f} GiB)"
        rows = [
            ("model", self.flavor),
            ("parameters", f"{self.params:,} ({self.params / 1e9:.3f}B)"),
            ("non-embedding parameters", f"{self.non_embedding_params:,}"),
            *([("active parameters per token", f"{self.active_params:,}")]
              if self.active_params and self.active_params != self.params else []),
            ("FLOPs per token", f"{self.flops_per_token:.4g}"
             + (" (active parameters + attention)" if self.active_params and self.active_params != self.params else "")),
            ("tokens per step (global)", f"{self.tokens_per_step:,}"),
            ("FLOPs per step (global)", f"{self.flops_per_step:.4g}"),
            ("world size / layout", f"{self.world_size} / {self.layout}"),
            ("precision / activation ckpt", f"{self.mixed_precision} / {self.ac_mode}"),
            ("gradient accumulation", str(self.grad_accum_steps)),
            ("memory per rank: params", f"{self.mem_params_gib:.3f} GiB"),
            ("memory per rank: grads", f"{self.mem_grads_gib:.3f} GiB"),
            ("memory per rank: optimizer", f"{self.mem_optimizer_gib:.3f} GiB"),
            ("memory per rank: activations", f"{self.mem_activations_gib:.3f} GiB"),
            ("memory per rank: transient", f"{self.mem_transient_gib:.3f} GiB"),
            ("memory per rank: peak", f"{self.mem_total_gib:.3f} GiB{fits}"),
        ]
        if self.expert_parallel > 1:
            rows.append(("expert all-to-all per rank", f"{self.alltoall_gib_per_step:.3g} GiB/step"))
        if self.step_time_s_at_mfu40 is not None:
            rows.append(("step time at 40% MFU", f"{self.step_time_s_at_mfu40:.3g} s"))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


# Device memory (GiB) by GPU name in cluster.name / cluster.constraint.
DEVICE_MEMORY_GIB = {"h200": 141.0, "h100": 80.0, "a100": 80.0, "b200": 180.0, "l40s": 48.0}


def device_memory_of(cfg: DictConfig) -> float | None:
    c = cfg.cluster
    if c.device != "cuda":
        return None
    if OmegaConf.select(cfg, "cluster.gpu_mem_gib") is not None:  # the cluster says (96 GB H100s)
        return float(c.gpu_mem_gib)
    text = f"{c.name} {OmegaConf.select(cfg, 'cluster.constraint') or ''}".lower()
    for key, gib in DEVICE_MEMORY_GIB.items():
        if key in text:
            return gib
    return None


def stage_params(args: ModelShape, pp: int) -> float:
    """Parameters of the largest pipeline stage (blocks split evenly + embedding or output)."""
    if pp == 1:
        return args.params
    return math.ceil(args.n_layers / pp) * args.block_params + max(args.embedding_params, args.head_params)


def plan(cfg: DictConfig, dims, runtime: Runtime = TITAN_HYDRA) -> Plan:
    """Parameters, FLOPs and per-rank peak memory of ``cfg`` on ``dims``, without allocating.

    Peak = fp32 params + AdamW state (8 B/param) + max(saved activations at the start of
    backward, full gradients + optimizer-step temporaries), each divided by how the layout splits
    it: FSDP shards params/grads/state over dp_shard*cp, TP splits weights and heads, PP keeps
    one stage (with the pipeline's in-flight microbatches), CP splits the sequence. FSDP adds the
    unsharded parameters/gradients of the groups being computed (the output group and last block
    at the start of backward), and a third candidate peak at the end of backward (sharded grads
    + one unsharded group being reduce-scattered).
    """
    family, margs = args_of(cfg.model)
    args = family.shape(margs)
    t = cfg.training
    mp = mixed_precision_of(cfg)
    ac = cfg.activation_checkpoint
    n = args.params
    n_emb = args.embedding_params
    fpt = family.flops_per_token(margs, t.seq_len)
    local_bs = t.local_batch_size
    global_bs, accum = dims.batch_plan(local_bs, t.global_batch_size)
    tokens = global_bs * t.seq_len
    fsdp_shard = dims.dp_shard * dims.cp if dims.fsdp_enabled else 1
    params_local = stage_params(args, dims.pp) / dims.tp / fsdp_shard
    mem_params = params_local * 4  # fp32 master weights
    mem_grads = params_local * 4
    mem_optim = params_local * 8  # AdamW exp_avg + exp_avg_sq
    kind = precision_kind(mp, dims.fsdp_enabled)
    local_tokens = local_bs * t.seq_len / dims.cp
    if dims.pp > 1:  # microbatches in flight on the first stage: up to pp of them
        micro = dims.pp_microbatches or dims.pp
        local_tokens = local_tokens / micro * min(micro, dims.pp)
    layers = math.ceil(args.n_layers / dims.pp)
    moe_layers = math.ceil(args.moe_layers / dims.pp)
    ep = int(getattr(dims, "ep", 1))
    act = activation_bytes(args, kind, ac.mode, local_tokens, layers, int(ac.selective_layer_freq), dims.tp,
                           str(ac.get("selective_op_policy", "all_mm")))
    act += moe_layers * moe_activation_bytes(args, kind, ac.mode, local_tokens)
    act += head_activation_bytes(args, local_tokens, dims)
    act += fp32_attention_bytes(cfg, args, mp, ac, local_tokens, layers, dims.tp)
    if kind == "bf16":  # autocast's bf16 copies of the weights live until backward ends
        act += params_local * 2
    transient = end_of_backward = 0.0
    if dims.fsdp_enabled:
        block = largest_block_params(args, ep) / dims.tp
        head = args.head_params / dims.tp
        pbytes = 2 if kind == "bf16_params" else 4
        transient = (head + block) * (pbytes + 4)  # unsharded params + their unsharded grads
        # Last groups of backward: (almost) every sharded gradient already exists while a group
        # is still unsharded: its params, its unsharded grads and reduce-scatter's fp32 copy-in.
        # This is the peak when parameters outweigh activations (the ~100M model at 128 tokens).
        end_of_backward = mem_grads + max(head, block) * (2 * pbytes + 4)
    # AdamW on CUDA is foreach (a temporary as large as all local params); on CPU it loops
    # per tensor (a temporary as large as the largest one: embedding/output or an FFN weight).
    expert_tensor = args.expert_params / max(3 * args.moe_layers, 1)  # one of w1/w2/w3 of a layer
    largest = max(n_emb, args.dim * args.ffn_dim, expert_tensor) / dims.tp / fsdp_shard
    optimizer_step = mem_grads + 4 * (params_local if cfg.cluster.device == "cuda" else largest)
    if cfg.cluster.device == "cuda" and kind == "bf16_params":
        # CUDA: what the run holds (cuda_dynamic_peak) times the caching allocator's reserve.
        dyn, unsharded = cuda_dynamic_peak(cfg, dims, args, runtime)
        dyn += moe_layers * moe_activation_bytes(args, kind, ac.mode, local_tokens)
        act, transient = dyn - unsharded, unsharded
        compiled = str(OmegaConf.select(cfg, "compile.mode", default="none")) != "none"
        reserve = ALLOCATOR_RESERVE_COMPILED if compiled else ALLOCATOR_RESERVE_EAGER
        peak = mem_params + mem_optim + reserve * max(dyn, optimizer_step, end_of_backward)
    else:
        peak = mem_params + mem_optim + max(act + transient, optimizer_step, end_of_backward)
    layout = f"dp_replicate={dims.dp_replicate} dp_shard={dims.dp_shard} tp={dims.tp} pp={dims.pp} cp={dims.cp}"
    if ep > 1:
        layout += f" ep={ep}"
    a2a = alltoall_bytes(args, kind, local_bs * t.seq_len / dims.cp * accum, moe_layers, ep)
    peak_tflops = OmegaConf.select(cfg, "cluster.peak_tflops")
    flops_rank = fpt * tokens / dims.world_size
    step_time = flops_rank / (0.4 * peak_tflops * 1e12) if peak_tflops else None
    return Plan(
        flavor=str(OmegaConf.select(cfg, "model.flavor", default=None) or "custom"), params=n,
        active_params=args.active_params, non_embedding_params=n - n_emb, flops_per_token=fpt,
        tokens_per_step=tokens, flops_per_step=fpt * tokens, world_size=dims.world_size, layout=layout,
        grad_accum_steps=accum, mem_params_gib=mem_params / GIB, mem_grads_gib=mem_grads / GIB,
        mem_optimizer_gib=mem_optim / GIB, mem_activations_gib=act / GIB, mem_total_gib=peak / GIB,
        mixed_precision=mp, ac_mode=str(ac.mode), mem_transient_gib=transient / GIB,
        device_memory_gib=device_memory_of(cfg),
        tflops_per_rank_at_mfu40=0.4 * peak_tflops if peak_tflops else 0.0, step_time_s_at_mfu40=step_time,
        expert_parallel=ep, alltoall_gib_per_step=a2a / GIB,
    )


def largest_block_params(args: ModelShape, ep: int = 1) -> float:
    """Parameters FSDP unshards at once for one block: the dense part plus a MoE layer's routed
    experts, of which expert parallelism keeps only 1/ep on a rank (sharded on their own mesh)."""
    if not args.moe_layers:
        return args.block_params
    expert_layer = args.expert_params / args.moe_layers
    dense_avg = args.block_params - args.expert_params / args.n_layers
    return dense_avg + expert_layer / max(ep, 1)
