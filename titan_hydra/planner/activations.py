"""Activation memory per transformer block, from coefficients measured on this model code.

Kept apart from the CUDA allocator model because these are measurements, not derivations: each
coefficient was taken with torch's dispatch-level MemTracker on CPU training steps, and
tests/test_estimator.py re-measures real steps against them (+-15%). The CPU plan uses them
directly; the CUDA model reuses the eager no-AC block (``block_activation_bytes``) and the loss
constants.
"""

from __future__ import annotations

import math

from titan_hydra.models.protocol import ModelShape


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
                           policy: str | None = None) -> float:
    """Saved activations of one block for ``tokens`` tokens (per rank: heads split by tp); ``policy``
    is the selective-op policy (``activation_checkpoint.selective_op_policy``) where ``mode`` is selective_op."""
    d, kv, f = args.dim, args.kv_dim, args.ffn_dim
    if mode == "full":
        return tokens * RESIDUAL_BYTES[kind] * d / tp  # only the block input
    cd, ckv, cf = ACT_COEF[(kind, mode)]
    if not args.gated_mlp:  # fc1 output and its GELU, where SwiGLU keeps w1 and w3 outputs, SiLU and product
        cf /= 2
    per_token = cd * d + ckv * kv + cf * f + 4 * args.n_heads
    if mode == "selective_op" and policy == "every_second_mm":
        per_token -= MM_OUT_BYTES[kind] * (d + kv + f)
    per_token += Q_WIDE_COEF[(kind, mode)] * max(args.q_dim - d, 0)
    if args.qk_norm and (kind, mode) in QK_NORM_COEF:
        per_token += QK_NORM_COEF[(kind, mode)] * (args.q_dim + kv) + 4 * (args.n_heads + args.n_kv_heads)
    return tokens * per_token / tp


def activation_bytes(args: ModelShape, kind: str, mode: str, tokens: float, layers: float,
                     freq: int, tp: int = 1, policy: str | None = None) -> float:
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


# Mixture-of-Experts layers save more than their active FFN width (already in ``ffn_dim``): the
# token copies routed to each of the top_k experts (gathered input, expert output, gate-weighted
# output: bytes per element of top_k x dim) and the router's fp32 logits and scores per expert;
# selective_op recomputes most of the copies. Fitted with MemTracker on qwen3_moe_debug and
# deepseek_v3_debug (estimate/measured 0.98-1.13; tests/test_estimator.py checks it).
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


# Gated DeltaNet layers of a hybrid (ModelShape.linear_*) save more per token than the attention
# they replace, and all of it linear in the sequence: the convolution's input, output and SiLU,
# the rule's per-value-head q/k/v copies, solution and outputs, the gated norm's inputs (widths);
# the [C, C] intra-chunk scores, decays and triangular system per value head (chunk); the per-chunk
# [dk, dk] transition and [dk, dv] state, scanned and stacked (state / C per token). Bytes per
# element of that count, net of the attention tensors the block coefficients already hold. fp32 and
# bf16 without AC: fitted with MemTracker on qwen3_5_debug (4 layers, all-linear vs all-full vs 3:1,
# seq 256 -> 512: 27.4 kB (fp32) and 22.7 kB (bf16) per token and layer over an attention layer);
# bf16 is close to fp32 because the rule runs in fp32 whatever the input. bf16 FSDP params and
# selective AC: simulated at Qwen3.5-9B's widths (4 layers all-linear vs all-full, 8,192 tokens;
# selective_op saves the rule's matmul outputs and recomputes the rest: 0.41x of none). Full AC
# keeps the block input only.
LINEAR_ATTN_COEF = {("fp32", "none"): 3.24, ("bf16", "none"): 2.69, ("bf16_params", "none"): 2.95,
                    ("fp32", "selective_op"): 1.21, ("bf16", "selective_op"): 1.24,
                    ("bf16_params", "selective_op"): 1.24}


def linear_attention_elements(args: ModelShape) -> float:
    """Elements per token one Gated DeltaNet layer saves for backward (torch chunked form)."""
    hv, dk, c = args.linear_v_heads, args.linear_k_head_dim, args.linear_chunk
    key, value = args.linear_k_heads * dk, hv * args.linear_v_head_dim
    widths = 3 * (2 * key + value) + 6 * hv * dk + 9 * value
    return widths + 5 * hv * c + 2 * hv * dk * (dk + args.linear_v_head_dim) / c


def linear_attention_bytes(args: ModelShape, kind: str, mode: str, tokens: float, tp: int = 1) -> float:
    """What one linear-attention layer saves beyond an attention block, per rank (0 for a model
    without them, and under full AC: only the block input is kept). Tensor parallel keeps whole
    heads per rank, so every term splits by tp, as the block's do."""
    if not args.linear_layers or mode == "full":
        return 0.0
    coef = LINEAR_ATTN_COEF[(kind, "selective_op" if mode == "selective_op" else "none")]
    return tokens * coef * linear_attention_elements(args) / tp


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


def head_activation_bytes(args: ModelShape, tokens: float, dims, kind: str = "fp32") -> float:
    """Final norm + logits at the loss backward: the fp32 log-softmax kept for backward, its
    gradient and the logits' gradient (12 B/vocab; the logits themselves are dropped before
    backward, parallel/runner.py). Each multi-token prediction depth adds one such head and one
    block that is never checkpointed (its MoE extra is in ``moe_layers`` already)."""
    head = tokens * (12 * args.dim + loss_bytes_per_token(args, dims))
    mtp_block = block_activation_bytes(args, kind, "none", tokens, dims.tp) if args.mtp_layers else 0.0
    return head + args.mtp_layers * (head + mtp_block)
