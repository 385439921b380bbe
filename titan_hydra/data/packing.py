"""Packing: documents -> one flat token stream per split.

Every document becomes ``[bos] + tokens + [eos]`` and the documents of a split are concatenated
into one int32 array; sample i is the window ``tokens[i*seq_len : i*seq_len + seq_len + 1]``. The
streaming loader frames documents the same way (``frame``), so both paths see the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from titan_hydra.data.tokenizer import Tokenizer

SPLITS = ("train", "val")


def new_stats() -> dict[str, Any]:
    """What a token dataset reports about its splits: documents kept, empty ones skipped, tokens."""
    return {"documents": {}, "empty_skipped": 0, "tokens": {}}


def is_document(text: Any) -> bool:
    """A record with text to train on (empty, blank and non-string records are skipped)."""
    return isinstance(text, str) and bool(text.strip())


def frame(ids_batch: Iterable[list[int]], bos: int, eos: int, out: list[int]) -> list[int]:
    """Append each document's ids to ``out`` as ``bos ids... eos``."""
    for ids in ids_batch:
        out.append(bos)
        out.extend(ids)
        out.append(eos)
    return out


@dataclass
class TokenSplits:
    """The flat token sequence of every split, and what a dataset reports about them."""

    tokens: dict[str, Sequence[int]]
    stats: dict[str, Any] = field(default_factory=new_stats)
    cache_key: str | None = None
    cache_hit: bool = False


def pack(text_chunks: Iterable[list], tokenizer: Tokenizer) -> tuple[np.ndarray, int, int]:
    """-> (flat int32 tokens, documents kept, empty documents skipped)."""
    parts, docs, empty = [], 0, 0
    for texts in text_chunks:
        kept = [t for t in texts if is_document(t)]
        empty += len(texts) - len(kept)
        if not kept:
            continue
        buf = frame(tokenizer.encode_batch(kept), tokenizer.bos_id, tokenizer.eos_id, [])
        parts.append(np.array(buf, dtype=np.int32))
        docs += len(kept)
    flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    return flat, docs, empty


def pack_splits(chunks: Callable[[str], Iterable[list]], tokenizer: Tokenizer) -> TokenSplits:
    """Pack every split, ``chunks(split)`` giving its documents a list at a time, train first."""
    out = TokenSplits({})
    for split in SPLITS:
        flat, docs, empty = pack(chunks(split), tokenizer)
        out.tokens[split] = flat
        out.stats["documents"][split] = docs
        out.stats["empty_skipped"] += empty
        out.stats["tokens"][split] = int(flat.size)
    return out
