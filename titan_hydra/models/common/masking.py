"""Which keys a query may see: causal, sliding window, chunked, and document boundaries.

Every attention variant here reduces to one boolean mask handed to SDPA (torch 2.13's
flex_attention has no CPU backward): key j is visible from query i iff j <= i and

* sliding window W: i - W < j (HF ``sliding_window``; GPT-OSS),
* chunk C: i // C == j // C (Llama 4's chunked local attention, HF ``attention_chunk_size``),
* documents: doc[i] == doc[j], with ``doc`` the index of each token's document inside a packed
  window (``data.document_mask=true``).

Documents are found from the tokens themselves: packing writes ``[bos] doc [eos]`` back to
back, so a new document starts right after every EOS (the EOS token belongs to the document it
ends; a window that starts mid-document counts its first tokens as document 0). Positions
restart at 0 with every document, so rotary sees each document as if it stood alone.

The mask is [S, S] without documents and [B, 1, S, S] with them (each sequence of the batch
packs different documents). That is O(S^2) booleans per layer call: fine at the lengths
trained on CPU; long contexts on GPU would want a block-sparse mask (flex_attention) instead.
"""

from __future__ import annotations

import torch


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[B, S] tokens -> [B, S] int64 index of each token's document in its window."""
    ends = (tokens == eos_id).to(torch.int64)
    return ends.cumsum(dim=-1) - ends  # an EOS still belongs to the document it closes


def positions_in_documents(doc_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] document ids (non-decreasing along S) -> [B, S] int64 position within each document."""
    s = doc_ids.shape[-1]
    idx = torch.arange(s, device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[..., 1:] = doc_ids[..., 1:] != doc_ids[..., :-1]
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=-1).values
    return idx - first


def visible_keys(seq_len: int, window: int | None = None, device=None, *, chunk: int | None = None,
                 doc_ids: torch.Tensor | None = None, q_offset: int = 0, kv_len: int | None = None) -> torch.Tensor:
    """Boolean mask, True = visible: [S, T] (no documents) or [B, 1, S, S]. Queries sit at
    positions ``q_offset .. q_offset + S - 1`` and keys at ``0 .. T - 1`` (T = ``kv_len``,
    default S): a KV-cached decode step attends from its new tokens to everything before."""
    qpos = torch.arange(q_offset, q_offset + seq_len, device=device)
    kpos = torch.arange(seq_len if kv_len is None else kv_len, device=device)
    offset = qpos[:, None] - kpos[None, :]
    keep = offset >= 0
    if window is not None:
        keep = keep & (offset < window)
    if chunk is not None:
        keep = keep & ((qpos[:, None] // chunk) == (kpos[None, :] // chunk))
    if doc_ids is not None:
        same = doc_ids[:, :, None] == doc_ids[:, None, :]
        keep = (keep.to(same.device) & same).unsqueeze(1)
    return keep
