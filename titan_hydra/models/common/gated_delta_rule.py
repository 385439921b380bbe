"""The gated delta rule in plain torch: the chunked form for training, the recurrent form for decoding.

Per value head, with a state S [dk, dv], a decay a_t = exp(g_t) (g_t <= 0) and a write strength
beta_t in (0, 1), each token does

    S <- a_t S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t * scale

(Gated DeltaNet, Yang et al. 2024: the state forgets by a_t, then corrects what it predicts for
k_t towards v_t). The recurrent form runs exactly that, one token at a time (decoding). The
chunked form computes the same outputs for chunks of C tokens at once (the WY/UT form):
inside a chunk every token's correction u_i solves one unit lower-triangular system,

    (I + L) U = beta V - (beta Gamma K) S0,   L_ij = beta_i (k_i . k_j) a_(j..i]  (j < i),

so U = Ut - W S0 with Ut, W from one batched triangular solve over all chunks, and the only
sequential part left is the chunk-to-chunk state, S_next = M S0 + B with M, B [dk, dk], [dk, dv]
precomputed per chunk: one batched matmul-add per chunk. The outputs are then two batched
matmuls over all chunks at once (the state's read, Q Gamma S0, and the causal intra-chunk
attention, A U). transformers' torch fallback instead runs four matmuls, an indexed write and
the output per chunk inside its Python loop and solves twice; that loop and its autograd graph
(each chunk's indexed read writes a zero-filled full copy in backward) dominate its time on long
sequences.

Documents (packed sequences): ``starts`` [B, T] marks tokens that begin a new document. The
state is zeroed before such a token, which is a_t = 0: every decay product a_(j..i] then
carries a "same document" factor, computed from a running document counter (a reset written
as g = -inf would turn the in-chunk decay differences into inf - inf). Grouped heads: q/k may have fewer heads than v; each q/k head serves
Hv / Hk consecutive value heads (as transformers and flash-linear-attention do).

Everything runs in fp32 whatever the input dtype (fp64 stays fp64; the output is cast back):
the triangular solve and the decay products are not safe in bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _wide(x: torch.Tensor) -> torch.Tensor:
    """x in fp32, or in fp64 if it is fp64 (the tests' exact reference)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _heads_first(x: torch.Tensor, reps: int = 1) -> torch.Tensor:
    """[B, T, H, ...] -> fp32 [B, H * reps, T, ...] (each head repeated ``reps`` times in place)."""
    if reps > 1:
        x = x.repeat_interleave(reps, dim=2)
    return _wide(x.transpose(1, 2))


def _segments(starts: torch.Tensor | None, batch: int, total: int, chunk: int, device) -> torch.Tensor | None:
    """[B, T] document starts -> [B, 1, N, C] running document counter (None without documents).
    Two positions share a document iff their counters are equal; the pad (past T) continues
    the last document."""
    if starts is None:
        return None
    seg = starts.to(device=device, dtype=torch.int64).cumsum(dim=-1)
    seg = F.pad(seg, (0, total - seg.shape[-1]), mode="replicate") if total > seg.shape[-1] else seg
    return seg.view(batch, 1, -1, chunk)


def _decays(g: torch.Tensor, seg: torch.Tensor | None):
    """Decay products of one chunk layout g [B, H, N, C]: (pair [.., C, C] = a_(j..i] for j <= i
    else 0; into [.., C] = a_(start..i] from the previous chunk's state; out [.., C] = a_(i..end];
    whole [.., N] = the chunk's total decay of the incoming state)."""
    c = g.shape[-1]
    causal = torch.ones(c, c, dtype=torch.bool, device=g.device).tril()
    if seg is None:
        cum = g.cumsum(dim=-1)
        keep, into_ok, out_ok, whole_ok = causal, None, None, None
    else:
        keep = causal & (seg.unsqueeze(-1) == seg.unsqueeze(-2))
        # the running sum within each document only: with a plain cumsum, a later document's decay
        # differences would cancel an earlier one's g only up to rounding, in backward too (its
        # gradient would reach across the boundary at ~1e-8 instead of exactly 0)
        cum = (keep.to(g.dtype) @ g.unsqueeze(-1)).squeeze(-1)
        before = F.pad(seg[..., :-1, -1], (1, 0))  # counter of the token before each chunk
        into_ok = seg == before.unsqueeze(-1)
        out_ok = seg == seg[..., -1:]
        whole_ok = seg[..., -1] == before
    pair = torch.where(keep, cum.unsqueeze(-1) - cum.unsqueeze(-2), float("-inf")).exp()
    last = cum[..., -1:] - cum
    if seg is not None:
        # masked before exp, as pair is: from an earlier document of the chunk, the later one's sum
        # minus its own can exceed 88 (strong decays) and exp gives inf, which times 0 is nan
        last = torch.where(out_ok, last, float("-inf"))
    into, out, whole = cum.exp(), last.exp(), cum[..., -1].exp()
    if seg is not None:
        into, whole = into * into_ok, whole * whole_ok
    return pair, into, out, whole


def _scan(m: torch.Tensor, b: torch.Tensor, s0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """S_(c+1) = M_c S_c + B_c over chunks: m [B, H, N, dk, dk], b [B, H, N, dk, dv], s0 [B, H, dk, dv]
    -> (the state before each chunk [B, H, N, dk, dv], the state after the last)."""
    bsz, h, n, dk, dv = b.shape
    state = s0.flatten(0, 1)
    before = []
    # unbind, not m[:, c]: each indexed read's backward would write a whole zero-filled copy
    for m_c, b_c in zip(m.flatten(0, 1).unbind(1), b.flatten(0, 1).unbind(1)):
        before.append(state)
        state = torch.baddbmm(b_c, m_c, state)
    return torch.stack(before, dim=1).view(bsz, h, n, dk, dv), state.view(bsz, h, dk, dv)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           *, scale: float, chunk_size: int = 64, starts: torch.Tensor | None = None,
                           initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked form. q, k [B, T, Hk, dk]; v [B, T, Hv, dv]; g (log decay), beta [B, T, Hv];
    ``starts`` [B, T] bool (a document begins: the state resets before it); ``initial_state``
    [B, Hv, dk, dv]. Returns (o [B, T, Hv, dv] in v's dtype, final state [B, Hv, dk, dv] fp32)."""
    bsz, t, hk, dk = k.shape
    hv, dv, dtype = v.shape[2], v.shape[3], v.dtype
    reps, c = hv // hk, chunk_size
    pad = (c - t % c) % c  # pad tokens: beta = 0 writes nothing, g = 0 decays nothing
    q, k, v = (F.pad(_heads_first(x, r), (0, 0, 0, pad)) for x, r in ((q, reps), (k, reps), (v, 1)))
    g, beta = (F.pad(_wide(x.transpose(1, 2)), (0, pad)) for x in (g, beta))
    n = (t + pad) // c
    q, k, v = (x.view(bsz, hv, n, c, -1) for x in (q, k, v))
    g, beta = g.view(bsz, hv, n, c), beta.view(bsz, hv, n, c, 1)
    pair, into, out, whole = _decays(g, _segments(starts, bsz, t + pad, c, q.device))

    # One triangular solve for both right-hand sides; pieces taken with split, whose backward is
    # one cat (a slice's writes a zero-filled copy). The q and k.beta products stay two bmm calls:
    # stacked into one [2C, d] operand they take MKL's slower batched path on CPU.
    kb = k * beta
    kt = k.transpose(-1, -2)
    attn, lower = (q @ kt) * pair, (kb @ kt) * pair  # lower: only its strict lower triangle is read
    solved = torch.linalg.solve_triangular(lower, torch.cat([v * beta, kb * into.unsqueeze(-1)], dim=-1),
                                           upper=False, unitriangular=True)
    u_tilde, w = solved.split([dv, dk], dim=-1)
    k_out = (k * out.unsqueeze(-1)).transpose(-1, -2)  # [.., dk, C]: each token's key decayed to the chunk end
    b_c, kw = (k_out @ solved).split([dv, dk], dim=-1)
    eye = torch.eye(dk, dtype=k.dtype, device=k.device)
    s0 = k.new_zeros(bsz, hv, dk, dv) if initial_state is None else initial_state.to(k.dtype)
    states, final = _scan(whole[..., None, None] * eye - kw, b_c, s0)
    o = ((q * into.unsqueeze(-1)) @ states + attn @ (u_tilde - w @ states)) * scale
    o = o.view(bsz, hv, n * c, dv)[:, :, :t].transpose(1, 2)
    return o.to(dtype), final


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, *, scale: float, starts: torch.Tensor | None = None,
                               initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrent form, one token at a time (decoding; also the chunked form's reference).
    Same arguments and results as ``chunk_gated_delta_rule``."""
    bsz, t, hk, dk = k.shape
    hv, dv, dtype = v.shape[2], v.shape[3], v.dtype
    q, k = _heads_first(q, hv // hk), _heads_first(k, hv // hk)
    v, g, beta = _heads_first(v), _wide(g.transpose(1, 2)), _wide(beta.transpose(1, 2))
    decay = g.exp()
    if starts is not None:  # a_t = 0 where a document begins
        decay = decay * ~starts.to(device=decay.device, dtype=torch.bool).unsqueeze(1)
    state = k.new_zeros(bsz, hv, dk, dv) if initial_state is None else initial_state.to(k.dtype)
    outs = []
    for i in range(t):
        state = state * decay[:, :, i, None, None]
        k_i = k[:, :, i]
        delta = (v[:, :, i] - (k_i.unsqueeze(-2) @ state).squeeze(-2)) * beta[:, :, i, None]
        state = state + k_i.unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append((q[:, :, i].unsqueeze(-2) @ state).squeeze(-2) * scale)
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(bsz, hv, 0, dv)
    return o.transpose(1, 2).to(dtype), state
