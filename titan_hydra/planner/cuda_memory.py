"""CUDA memory model: the dynamic peak of a step and the caching allocator's reserve over it.

On a GPU the peak that matters is the caching allocator's reserved memory (what torchtitan logs
and what an OOM is measured against); the terms here are derived from what the code holds, op by
op, and checked against torchtitan's published H100 runs (tests/test_estimator_published.py,
tests/data/torchtitan_h100_202412.yaml). Kept apart from the measured CPU coefficients
(activations.py), which it reuses only for the eager no-AC block and the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_hydra.models.protocol import ModelShape
from titan_hydra.planner.activations import block_activation_bytes, loss_bytes_per_token
from titan_hydra.planner.pipeline import pipeline_order, stage_layer_counts
from titan_hydra.planner.runtime import Runtime
from titan_hydra.planner.shape import largest_block_params, largest_reduce_group_params
from titan_hydra.spec import RunSpec


# Reserved / allocated memory of the CUDA caching allocator at the peak. Blocks freed in one size
# class are not reusable by a larger request, so the reserved pool exceeds the live tensors.
# Compiled blocks allocate a few fixed-size fused buffers; eager blocks also allocate and free
# RMSNorm's fp32 upcasts and RoPE's fp32 complex copies (2-4x a bf16 activation) in every forward
# and recompute, which splits cached segments further. One constant for each, calibrated on the
# published ratio of eager to compiled 8B runs (82.4/77.0 = 1.07 and 67.0/62.0 = 1.08) and on
# the usual 5-10% fragmentation of compiled steady-state training; not fitted per row.
ALLOCATOR_RESERVE_COMPILED = 1.08
ALLOCATOR_RESERVE_EAGER = 1.155


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
    the final norm's output the output projection saved (all-gathered: 2d per token); once more
    per multi-token prediction depth (all depths' logits are scored before backward)."""
    return (1 + args.mtp_layers) * tokens * (loss_bytes_per_token(args, dims) + 2 * args.dim)


def saved_block_bytes_cuda(args: ModelShape, mode: str, tokens: float, tp: int, policy: str,
                           sequence_parallel: bool = False) -> float:
    """What one block keeps for backward on CUDA for ``tokens`` (bf16 activations, FSDP bf16 params).

    Without AC under sequence parallel, the two norm outputs the block all-gathers (attention's
    and the FFN's input, 2d bytes each) are saved whole, for the full sequence, by the matmuls
    that read them: the measured coefficients split every term by tp, so the rest of each
    gathered copy is added (+57% per block on llama3_70b at tp 8, which is what the simulator
    measured beyond this estimate on fsdp x tp; selective_op recomputes the gathers)."""
    if mode == "full":
        return tokens * 2 * args.dim / tp  # the block input (sequence-sharded under SP)
    if mode == "selective_op":
        return tokens * sac_saved_bytes_per_token(args, policy, tp)
    gathered = tokens * 2 * 2 * args.dim * (1 - 1 / tp) if sequence_parallel and tp > 1 else 0.0
    return block_activation_bytes(args, "bf16_params", "none", tokens, tp) + gathered


@dataclass(frozen=True)
class StepTerms:
    """The byte terms of one step that the schedule does not change (per rank, CUDA, bf16 FSDP)."""

    tp: int
    sequence_parallel: bool  # TP's sequence parallel: blocks all-gather their norm outputs
    ac_mode: str  # as modeled on CUDA (selective_layer counted as none: the upper bound)
    sac_policy: str
    compiled: bool
    fsdp: bool
    weight_bytes: int  # per unsharded block weight element (1 under float8 all-gather)
    block_weights: float  # one block as FSDP unshards it (the largest; 0 without FSDP)
    root_weights: float  # embedding + output, unsharded (0 without FSDP)
    block_grads: float  # one FSDP group's unsharded grads: bf16 + the fp32 reduce-scatter input
    layer_params: float  # parameters of one layer on average (what a pipeline stage holds)


def step_terms(spec: RunSpec) -> StepTerms:
    """What FSDP unshards and what AC recomputes, from the run's groups and its layout."""
    dims, args = spec.dims, spec.shape
    tp = dims.tp
    f8 = spec.float8
    fp8_gather = bool(f8.enabled and f8.enable_fsdp_float8_all_gather)
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
    ac = spec.activation_checkpoint
    mode = ac.mode
    return StepTerms(
        tp=tp, sequence_parallel=bool(dims.tp_sequence_parallel), ac_mode="none" if mode == "selective_layer" else mode,
        sac_policy=ac.policy, compiled=spec.compiler.enabled,
        fsdp=bool(dims.fsdp_enabled), weight_bytes=w_bytes, block_weights=block_w, root_weights=root_w,
        block_grads=largest_reduce_group_params(args, ep) / tp * (2 + 4), layer_params=avg_blk,
    )


def cuda_dynamic_peak(spec: RunSpec, runtime: Runtime, pp_rank: int | None = None,
                      seq_len: int | None = None) -> tuple[float, float]:
    """(peak bytes above the sharded fp32 state, unsharded parameter bytes within it) on the
    worst rank (or on pipeline rank ``pp_rank``), on CUDA with bf16 FSDP params.

    Without PP: the saved activations of every block, plus the larger of the loss backward's
    peak (with the root groups unsharded) and one block's recompute with its unsharded gradients
    (bf16, + fp32 reduce-scatter input), its weights and the next block's unsharded beside the root.
    With PP (FSDP does not reshard after forward and does not reduce-scatter until the last
    microbatch, as torchtitan and titan_hydra do): the whole stage's parameters stay unsharded, and
    after a stage's first backward its gradients accumulate unsharded in fp32 (FSDP2's
    reduce_dtype); the schedule (``pipeline_order``) decides how many microbatches' activations
    are alive at each moment; the worst moment of the worst rank counts. ``seq_len``: positions
    per sample where they are not ``training.seq_len`` (the family's ``sample_tokens``).
    """
    dims, args = spec.dims, spec.shape
    seq = int(seq_len or spec.batch.seq_len)
    tokens = spec.batch.local * seq / dims.cp
    terms = step_terms(spec)
    if dims.pp == 1:
        return unpipelined_peak(args, dims, terms, tokens)
    return pipelined_peak(args, dims, terms, runtime, tokens, pp_rank)


def recompute_with_grads(args: ModelShape, terms: StepTerms, tokens: float) -> float:
    """One block rebuilt in backward (under AC) while its unsharded gradients exist."""
    rebuild = recompute_bytes(args, tokens, terms.tp, terms.compiled) if terms.ac_mode != "none" else 0.0
    return rebuild + terms.block_grads


def unpipelined_peak(args: ModelShape, dims, terms: StepTerms, tokens: float) -> tuple[float, float]:
    """``cuda_dynamic_peak`` without PP, for this rank's ``tokens`` per step."""
    sp = terms.sequence_parallel
    saved = args.n_layers * saved_block_bytes_cuda(args, terms.ac_mode, tokens, terms.tp, terms.sac_policy, sp)
    saved += args.mtp_layers * saved_block_bytes_cuda(args, "none", tokens, terms.tp, terms.sac_policy, sp)
    # Two candidate moments. The loss backward: every block resharded after its forward, the root
    # groups (embedding, head) unsharded. A block's backward: its recompute and unsharded grads,
    # its weights and the next block's (prefetched) unsharded beside the root. The simulator showed
    # the first holding no block weights (llama4_maverick, fsdp x ep: only the two root-sized bf16
    # tensors at the loss backward's peak), which one sum of both overcounted.
    at_loss = loss_peak_bytes(args, tokens, dims) + terms.root_weights
    blocks = 2 * terms.block_weights
    at_block = recompute_with_grads(args, terms, tokens) + terms.root_weights + blocks
    unsharded = terms.root_weights + (blocks if at_block > at_loss else 0.0)
    return saved + max(at_loss, at_block), unsharded


@dataclass(frozen=True)
class MicrobatchBytes:
    """What one pipeline microbatch holds on a stage (bytes)."""

    n_mb: int
    per_block: float  # saved for backward by one block
    io: float  # a stage's input or output (the residual stream)
    logits: float  # the last stage's output
    backward_extra: float  # one block's recompute + unsharded grads
    loss_peak: float  # the loss backward's peak (last stage)


def microbatch_bytes(args: ModelShape, dims, terms: StepTerms, tokens: float) -> MicrobatchBytes:
    """torch.distributed.pipelining's buffers (stage.py): a stage that receives activations has a
    recv buffer per microbatch, one that receives gradients a grad buffer per microbatch, both
    allocated once and kept; fwd_cache keeps each in-flight microbatch's stage output until its
    backward. Stage I/O is the residual stream, sequence-sharded under TP's sequence parallel;
    the last stage's output is its logits (vocab-sharded under loss parallel)."""
    n_mb = int(dims.pp_microbatches or dims.pp)
    mb_tokens = tokens / n_mb
    tp = terms.tp
    return MicrobatchBytes(
        n_mb=n_mb, per_block=saved_block_bytes_cuda(args, terms.ac_mode, mb_tokens, tp, terms.sac_policy,
                                                     terms.sequence_parallel),
        io=mb_tokens * 2 * args.dim / (tp if dims.tp_sequence_parallel else 1),
        logits=mb_tokens * 2 * args.vocab_size / (tp if dims.loss_parallel_enabled else 1),
        backward_extra=recompute_with_grads(args, terms, mb_tokens),
        loss_peak=loss_peak_bytes(args, mb_tokens, dims),
    )


def pipelined_peak(args: ModelShape, dims, terms: StepTerms, runtime: Runtime, tokens: float,
                   pp_rank: int | None) -> tuple[float, float]:
    """``cuda_dynamic_peak`` with PP: the worst of the pipeline ranks (or rank ``pp_rank``)."""
    mb = microbatch_bytes(args, dims, terms, tokens)
    sizes = stage_layer_counts(dims, args.n_layers, runtime)
    n_local = len(sizes) // dims.pp
    worst = (0.0, 0.0)
    for rank in range(dims.pp) if pp_rank is None else [pp_rank]:
        stages = [rank + k * dims.pp for k in range(n_local)]
        unsharded = stage_unsharded_bytes(args, terms, sizes, stages)
        peak = schedule_peak(dims, runtime, rank, stages, sizes, mb, terms, args)
        if peak + unsharded > sum(worst):
            worst = (peak, unsharded)
    return worst[0] + worst[1], worst[1]


def stage_unsharded_bytes(args: ModelShape, terms: StepTerms, sizes: list[int], stages: list[int]) -> float:
    """A rank's stages' parameters, kept unsharded by FSDP through the whole step."""
    if not terms.fsdp:
        return 0.0
    last = len(sizes) - 1
    unsharded = sum(sizes[s] * terms.layer_params / terms.tp * terms.weight_bytes for s in stages)
    unsharded += (args.embedding_params / terms.tp * 2 if 0 in stages else 0.0)
    unsharded += (args.head_params / terms.tp * 2 if last in stages else 0.0)
    return unsharded


def accumulated_grad_bytes(args: ModelShape, terms: StepTerms, sizes: list[int], stage: int) -> float:
    """fp32 gradients a stage accumulates unsharded between microbatches (FSDP reduce-scatters
    after the last one only): its blocks' (split by tp), the output head's on the last stage, and
    on the first the embedding's at the whole vocabulary: under TP the row-wise embedding's
    backward makes a Partial gradient of the full table (DTensor's strategy for
    ``embedding_dense_backward``), which FSDP accumulates as it is until its reduce-scatter
    (simulated: 3.9 GiB on llama3_70b's first stage, fsdp x tp 8 x pp 4)."""
    grads = sizes[stage] * terms.layer_params / terms.tp * 4
    if stage == 0:
        grads += args.embedding_params * 4
    if stage == len(sizes) - 1:
        grads += args.head_params / terms.tp * 4
    return grads


def schedule_peak(dims, runtime: Runtime, rank: int, stages: list[int], sizes: list[int],
                  mb: MicrobatchBytes, terms: StepTerms, args: ModelShape) -> float:
    """The most a rank holds at any backward of its schedule: in-flight microbatches'
    activations and stage outputs, the p2p buffers, gradients accumulated so far, and the
    backward's own transient. A received input is also the first block's saved input (counted
    in ``per_block``), hence ``io`` is taken back for every stage but the first."""
    last = len(sizes) - 1
    n_local = len(stages)
    p2p = sum(mb.n_mb * mb.io * ((s != 0) + (s != last)) for s in stages)
    live = [0] * n_local
    done = [0] * n_local  # microbatches whose backward has run, per local stage
    peak = 0.0
    for op, k in pipeline_order(str(dims.pp_schedule), dims.pp, rank, mb.n_mb, n_local):
        if op == "F":
            live[k] += 1
            continue
        held = sum(n * (sizes[s] * mb.per_block + (mb.logits if s == last else mb.io) - (mb.io if s else 0))
                   for n, s in zip(live, stages)) + p2p
        if runtime.pp_keeps_outputs and last in stages:  # outputs kept past their backward
            held += done[stages.index(last)] * mb.logits
        # A stage's unsharded fp32 gradients exist from its first backward (made during it) until
        # its last, after which FSDP reduce-scatters and frees them (``pp_reduces_each_stage``):
        # the stage in backward now and the others part-way through theirs. Without it, those of
        # every stage past its first backward, to the step's end (the published-run calibration).
        # One microbatch: reduce-scattered as made.
        if runtime.pp_reduces_each_stage:
            accumulating = [mb.n_mb > 1 and (i == k or 0 < d < mb.n_mb) for i, d in enumerate(done)]
        else:
            accumulating = [mb.n_mb > 1 and d > 0 for d in done]
        acc = sum(accumulated_grad_bytes(args, terms, sizes, s) for g, s in zip(accumulating, stages) if g)
        extra = mb.backward_extra
        if stages[k] == last:
            extra = max(extra, mb.loss_peak)
        if stages[k] == 0:  # the embedding's gradient as its backward makes it (bf16, the whole table)
            extra = max(extra, args.embedding_params * 2)
        peak = max(peak, held + acc + extra)
        live[k] -= 1
        done[k] += 1
    return peak
