"""Causal attention through its score matrix: q @ k^T, a causal mask, an fp32 softmax, @ v.

Why, next to SDPA: on CPU at short sequences the score matrix is small and two batched bf16
matmuls (oneDNN) beat torch's CPU flash kernel, which walks the sequence in blocks and, with one
head size for q, k and v, pads MLA's narrower v to the q/k width. The causal product is cut into
query blocks (``_BlockCausal``), so the score matrix above the diagonal blocks is never computed.
The scores still cost B x H x S x S values per layer, so ``attention_kernel=auto`` only times
this kernel up to ``MAX_SEQ`` and keeps whichever is faster on the machine (timings against
flash: docs/bench/notes_models.md).

q and k may be wider than v (MLA): no padding is needed. The softmax runs in fp32 and its
probabilities are rounded once to v's dtype, as SDPA's math path does.
"""

from __future__ import annotations

import torch

MAX_SEQ = 512  # auto never considers longer sequences (memory ~ S^2, and flash is faster there)
BLOCKS = 4  # query blocks of the causal product (_BlockCausal)
MIN_BLOCK = 32  # rows per block at least; shorter sequences take fewer blocks or the whole matrix


def _future_keys(q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
    """[q_len, k_len] bool, True where a key lies after the query (aligned at the end)."""
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).triu(k_len - q_len + 1)


def scores_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                     blocks: int | None = None) -> torch.Tensor:
    """Causal softmax attention of [B, H, S, D] q/k and [B, H, S, Dv] v -> [B, H, S, Dv].
    ``blocks``: query blocks of the causal product (None: ``query_blocks``; 1: the whole score
    matrix, also whenever q and k differ in length)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if q.shape[-2] != k.shape[-2]:
        blocks = 1
    elif blocks is None:
        blocks = query_blocks(q.shape[-2])
    if blocks > 1:
        if q.shape[-2] % blocks:
            raise ValueError(f"scores_attention: {blocks} query blocks do not divide the sequence length {q.shape[-2]}")
        return _BlockCausal.apply(q, k, v, scale, blocks)
    # scale on q (S x D values, not S x S), mask in the matmul's dtype, softmax widened to fp32 in
    # its own pass: no fp32 copy of the whole S x S scores is ever made
    scores = torch.matmul(q * scale, k.transpose(-2, -1))
    scores = scores.masked_fill(_future_keys(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype), v)


def query_blocks(seq_len: int) -> int:
    """How many query blocks the causal product is cut into (1 = the whole score matrix)."""
    for blocks in (BLOCKS, 2):
        if seq_len % blocks == 0 and seq_len // blocks >= MIN_BLOCK:
            return blocks
    return 1


class _BlockCausal(torch.autograd.Function):
    """Causal attention on the lower block triangle of the score matrix only.

    Query block i (rows i*c..(i+1)*c) meets keys 0..(i+1)*c, so of the S x S products only
    (n+1)/2n are computed (5/8 with 4 blocks), in the forward and in all four backward products:
    dq of block i from its own rows, dk and dv of key block j from the query rows >= j*c (the rows
    above are zero in the probabilities and their gradient). Each product is one batched matmul
    over a block's rows, so no gradient is accumulated across blocks. Same roundings as the
    whole-matrix kernel: scores in the input dtype, softmax and its backward in fp32 (the fp32
    probabilities are what is kept for the backward), probabilities rounded once to v's dtype.
    """

    @staticmethod
    def forward(ctx, q, k, v, scale: float, blocks: int):
        c = q.shape[-2] // blocks
        # row-major once, so that no block's slice is copied again by its matmuls
        qs = torch.mul(q, scale, out=torch.empty(q.shape, dtype=q.dtype, device=q.device))
        k, v = k.contiguous(), v.contiguous()
        probs, out = [], []
        for i in range(blocks):
            lo, hi = i * c, (i + 1) * c
            scores = torch.matmul(qs[..., lo:hi, :], k[..., :hi, :].transpose(-2, -1))
            scores[..., lo:].masked_fill_(_future_keys(c, c, q.device), float("-inf"))
            p = torch.softmax(scores, dim=-1, dtype=torch.float32)
            probs.append(p)
            out.append(torch.matmul(p.to(v.dtype), v[..., :hi, :]))
        ctx.save_for_backward(qs, k, v, *probs)
        ctx.scale = scale
        return torch.cat(out, dim=-2)

    @staticmethod
    def backward(ctx, dout):
        qs, k, v, *probs = ctx.saved_tensors
        blocks = len(probs)
        c = qs.shape[-2] // blocks
        dout = dout.contiguous()
        dq, ds_blocks, p_blocks = [], [], []
        for i, p in enumerate(probs):
            lo, hi = i * c, (i + 1) * c
            dp = torch.matmul(dout[..., lo:hi, :], v[..., :hi, :].transpose(-2, -1)).float()
            ds = (p * (dp - (dp * p).sum(dim=-1, keepdim=True))).to(qs.dtype)
            dq.append(torch.matmul(ds, k[..., :hi, :]))
            ds_blocks.append(ds)
            p_blocks.append(p.to(v.dtype))
        dk, dv = [], []
        for j in range(blocks):
            lo, hi = j * c, (j + 1) * c
            # key block j meets the query rows of blocks j.. (rows above hold zeros)
            ds_t = torch.cat([ds[..., lo:hi] for ds in ds_blocks[j:]], dim=-2).transpose(-2, -1)
            p_t = torch.cat([p[..., lo:hi] for p in p_blocks[j:]], dim=-2).transpose(-2, -1)
            dk.append(torch.matmul(ds_t, qs[..., lo:, :]))
            dv.append(torch.matmul(p_t, dout[..., lo:, :]))
        dq = torch.cat(dq, dim=-2) * ctx.scale
        return dq, torch.cat(dk, dim=-2), torch.cat(dv, dim=-2), None, None
