"""Weighted mixtures of prepared corpora: ``data=mixture data.sources.<name>.path=... .weight=...``.

Why this order: the research question is usually the mix, so the share of each source must be
what the weights say, exactly and in every layout, and a sweep over one weight
(``python launch.py -m data.sources.code.weight=0.1,0.3,0.5``) must change nothing else.

* The global sample stream is cut into blocks of ``BLOCK`` samples; a block holds each source's
  share rounded by largest remainder (so every block, hence every run longer than a few blocks, is
  within 1/BLOCK of the weights), interleaved evenly (source s's k-th sample sits at (k + 1/2) /
  count_s of the block) rather than in runs, so every batch mixes the sources.
* Global position p is therefore the ``j``-th sample of its source, with ``j`` a closed form of p;
  each source serves its own windows in its own order (shuffled per epoch from the seed and the
  source's index), cycling when it runs out. The order depends only on the seed, the data and the
  weights, and the loader's state is the one global position of ``SampleStream``: a run resumes
  under any data-parallel layout.
* Validation: the mixed ``val/loss`` is the same construction over the sources' held-out splits,
  and every source's own ``val/<name>/loss`` is logged beside it.
"""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np
import torch

from titan_hydra.data.dataset import TokenDataset
from titan_hydra.data.loader import SampleStream, windows_to_batch
from titan_hydra.data.tokenizer import Tokenizer
from titan_hydra.errors import DataError

BLOCK = 512  # samples per block of the schedule: shares within 1/512 of the weights per block


def block_counts(weights: list[float], block: int = BLOCK) -> np.ndarray:
    """Samples per source in one block: ``block * w`` rounded by largest remainder (sums to block)."""
    w = np.asarray(weights, dtype=np.float64)
    exact = block * w / w.sum()
    counts = np.floor(exact).astype(np.int64)
    for s in np.argsort(-(exact - counts), kind="stable")[: block - counts.sum()]:
        counts[s] += 1
    return counts


def check_weights(weights: dict[str, Any]) -> None:
    """One-line DataError unless every weight is a number >= 0 and one is positive."""
    for name, w in weights.items():
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not np.isfinite(w) or w < 0:
            raise DataError(f"data.sources.{name}.weight={w} must be a number >= 0")
    if sum(weights.values()) <= 0:
        raise DataError("data.sources weights sum to 0; give at least one source a positive weight")


def check_sources(sources: Mapping[str, Any]) -> dict[str, float]:
    """The weights of ``data.sources`` ({name: {path, weight}}), or a one-line DataError: no sources,
    a source without a path or with one that does not exist, a bad weight (before anything is read)."""
    if not sources:
        raise DataError("data=mixture needs data.sources: +data.sources='{web: {path: prepared/web, weight: 0.7}, "
                        "code: {path: prepared/code, weight: 0.3}}'")
    for name, src in sources.items():
        if not isinstance(src, dict) or not src.get("path"):
            raise DataError(f"data.sources.{name} needs a path (a directory recipes/prepare_data.py wrote)")
        if not Path(str(src["path"])).expanduser().is_dir():
            raise DataError(f"data.sources.{name}.path={src['path']} does not exist")
    weights = {name: src.get("weight", 1.0) for name, src in sources.items()}
    check_weights(weights)
    return weights


class MixtureLoader(SampleStream):
    """``(inputs, labels)`` windows drawn from several token sequences in proportion to weights."""

    kind = "mixture"
    order_keys = ("split", "seq_len", "names", "weights", "num_samples", "shuffle", "seed")

    def __init__(self, sources: dict[str, Any], weights: dict[str, float], seq_len: int, local_batch_size: int,
                 dp_rank: int = 0, dp_degree: int = 1, shuffle: bool = True, seed: int = 0, infinite: bool = True,
                 split: str = "train"):
        check_weights(weights)
        self.names = [n for n in sources if weights[n] > 0]
        self.tokens = [sources[n] for n in self.names]
        self.seq_len = int(seq_len)
        self.windows = [max(0, (len(t) - 1) // self.seq_len) for t in self.tokens]
        empty = [n for n, w in zip(self.names, self.windows) if w == 0]
        if empty:
            raise DataError(f"source(s) {empty} have fewer {split} tokens than one sample of seq_len+1="
                            f"{self.seq_len + 1} (prepare more data or give them weight 0)")
        total = sum(weights[n] for n in self.names)
        self.weights = [round(weights[n] / total, 12) for n in self.names]
        self.counts = block_counts(self.weights)
        due = np.concatenate([(np.arange(c) + 0.5) / c for c in self.counts if c])
        owner = np.concatenate([np.full(c, s) for s, c in enumerate(self.counts) if c])
        self.order = owner[np.argsort(due, kind="stable")]  # the source of each slot of a block
        self.rank = np.zeros(BLOCK, dtype=np.int64)  # the slot's place among its source's slots
        for s in range(len(self.names)):
            slots = np.flatnonzero(self.order == s)
            self.rank[slots] = np.arange(len(slots))
        self._source_perms: dict[tuple[int, int], np.ndarray] = {}
        super().__init__(sum(self.windows), local_batch_size, dp_rank, dp_degree, shuffle, seed, infinite, split)

    def _source_perm(self, source: int, epoch: int) -> np.ndarray:
        key = (source, epoch)
        if key not in self._source_perms:
            if len(self._source_perms) >= 4 * len(self.names):
                self._source_perms.pop(next(iter(self._source_perms)))
            self._source_perms[key] = np.random.default_rng([self.seed, source, epoch]).permutation(self.windows[source])
        return self._source_perms[key]

    def sample_indices(self, start: int, count: int) -> np.ndarray:
        """[count, 2]: (source, window index) at global positions ``[start, start+count)``."""
        block, slot = np.divmod(np.arange(start, start + count), BLOCK)
        source = self.order[slot]
        nth = block * self.counts[source] + self.rank[slot]  # the n-th sample drawn from that source
        out = np.empty((count, 2), dtype=np.int64)
        out[:, 0] = source
        for s in np.unique(source):
            m = source == s
            epoch, within = np.divmod(nth[m], self.windows[s])
            if self.shuffle:
                out[m, 1] = [self._source_perm(int(s), int(e))[w] for e, w in zip(epoch, within)]
            else:
                out[m, 1] = within
        return out

    def fetch(self, indices: np.ndarray, positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        windows = np.empty((len(indices), self.seq_len + 1), dtype=np.int64)
        span = np.arange(self.seq_len + 1)
        for s in np.unique(indices[:, 0]):
            m = indices[:, 0] == s
            windows[m] = self.tokens[s][indices[m, 1][:, None] * self.seq_len + span[None, :]]
        return windows_to_batch(windows)


class MixtureDataset:
    """Several prepared corpora (``recipes/prepare_data.py``) trained on in proportion to weights.

    ``sources``: {name: {"path": prepared dir, "weight": float}}; every corpus must have been
    prepared with ``tokenizer``. The engine sees the interface of ``TokenDataset`` plus
    ``val_sources()`` (each source's own held-out split). ``draw``/``draw_alpha``: the Dirichlet
    draw a mixture search gave this run (``experiment=mixture_search``: the weights are
    ``${th_dirichlet:${data.draw},${data.draw_alpha}}``, resolved while composing); kept here so
    the run's header and config say where its weights came from.
    """

    def __init__(self, sources: Mapping[str, Any] = MappingProxyType({}), tokenizer: str = "builtin", seq_len: int = 256,
                 shuffle: bool = True, seed: int = 0, document_mask: bool = False, cache_dir: str | None = None,
                 draw: int | None = None, draw_alpha: float = 1.0):
        self.weights = check_sources(sources)
        self.draw, self.draw_alpha = draw, float(draw_alpha)
        self.seq_len, self.shuffle, self.seed = int(seq_len), bool(shuffle), int(seed)
        self.tokenizer = Tokenizer(tokenizer)
        self.vocab_size = self.tokenizer.vocab_size
        self.document_mask = bool(document_mask)
        self.parts = {n: TokenDataset("prepared", path=str(s["path"]), tokenizer=tokenizer, seq_len=seq_len,
                                      shuffle=shuffle, seed=seed, document_mask=document_mask)
                      for n, s in sources.items()}
        self.stats = {"sources": {n: {"weight": self.weights[n], **p.stats["tokens"]} for n, p in self.parts.items()},
                      "tokens": {split: sum(p.stats["tokens"][split] for p in self.parts.values())
                                 for split in ("train", "val")}}
        self.cache_hit = True

    @property
    def document_eos_id(self) -> int | None:
        return self.tokenizer.eos_id if self.document_mask else None

    def loader(self, split: str, local_batch_size: int, dp_rank: int = 0, dp_degree: int = 1, infinite: bool = True):
        return MixtureLoader({n: p.tokens(split) for n, p in self.parts.items()}, self.weights, self.seq_len,
                             local_batch_size, dp_rank, dp_degree, shuffle=self.shuffle and split == "train",
                             seed=self.seed, infinite=infinite, split=split)

    def val_sources(self) -> list[str]:
        """The sources whose own held-out loss is logged (``val/<name>/loss``)."""
        return list(self.parts)

    def source_loader(self, name: str, split: str, local_batch_size: int, dp_rank: int = 0, dp_degree: int = 1,
                      infinite: bool = True):
        return self.parts[name].loader(split, local_batch_size, dp_rank, dp_degree, infinite)

    def __repr__(self) -> str:
        drawn = "" if self.draw is None else f"; Dirichlet draw {self.draw}, alpha {self.draw_alpha}"
        return f"MixtureDataset({', '.join(f'{n}={w}' for n, w in self.weights.items())}{drawn})"
