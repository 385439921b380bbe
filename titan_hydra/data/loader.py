"""Stateful, deterministic, data-parallel batch loaders.

``SampleStream`` is the order and position of any indexed dataset; ``BatchLoader`` serves
fixed-length windows of a packed token array through it (an image dataset serves its examples
through the same stream: ``data/image_caption.py``). Its one idea: the
sample order is a single global stream (epoch 0's order, then epoch 1's, ...), and the
k-th call on dp rank r takes stream positions ``[(k*dp + r)*B, (k*dp + r + 1)*B)``.
So every data-parallel layout with the same global batch ``B*dp`` sees the same global
batches, row for row (rank 0's rows, then rank 1's, ...): that is what makes the loss
identical under 1 process and N data-parallel ranks. The state is one number, the global
samples consumed, so a checkpoint taken under one layout resumes under another.

``StreamingBatchLoader`` packs documents from an HF ``IterableDataset`` on the fly for
data too large to pre-tokenize. Documents are sharded across dp ranks by
``datasets.distributed.split_dataset_by_node`` and each rank packs its own stream, so it
is NOT layout-invariant: a different dp layout sees different batches, and its state can
only be loaded under the layout that saved it.
"""

from __future__ import annotations

import copy
from typing import Callable, Iterable, Iterator

import numpy as np
import torch

from titan_hydra.data.packing import frame, is_document
from titan_hydra.errors import DataError

STATE_VERSION = 1


def _check_layout(local_batch_size: int, dp_rank: int, dp_degree: int) -> None:
    if local_batch_size < 1:
        raise DataError(f"local_batch_size must be >= 1, got {local_batch_size}")
    if dp_degree < 1 or not 0 <= dp_rank < dp_degree:
        raise DataError(f"need 0 <= dp_rank < dp_degree, got dp_rank={dp_rank} dp_degree={dp_degree}")


def windows_to_batch(windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, seq_len+1] windows -> (inputs, labels) as int64 tensors, labels shifted by one."""
    w = torch.from_numpy(np.ascontiguousarray(windows, dtype=np.int64))
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


class SampleStream:
    """The global sample order of an indexed dataset of ``num_samples`` items, and this dp
    rank's place in it; a subclass turns sample indices into a batch (``fetch``).

    With ``shuffle`` the order within epoch e is ``default_rng(seed + e).permutation(N)``.
    ``infinite=True`` runs epoch after epoch (a global batch may straddle two epochs);
    ``infinite=False`` stops after the last *full* global batch of epoch 0, so every rank
    makes the same number of calls (the tail of fewer than ``B*dp`` samples is dropped).
    """

    kind = "samples"  # the state's kind: what a checkpoint of this loader can be restored into
    # Attributes a saved state must match (the data order), checked in this order.
    order_keys: tuple[str, ...] = ("split", "num_samples", "shuffle", "seed")

    def __init__(self, num_samples: int, local_batch_size: int, dp_rank: int = 0, dp_degree: int = 1,
                 shuffle: bool = False, seed: int = 0, infinite: bool = True, split: str = "train"):
        _check_layout(local_batch_size, dp_rank, dp_degree)
        self.num_samples = int(num_samples)
        self.local_batch_size = local_batch_size
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.global_batch_size = local_batch_size * dp_degree
        self.shuffle, self.seed, self.infinite, self.split = shuffle, seed, infinite, split
        if self.num_samples < 1:
            raise DataError(f"split {split!r} has no samples (add data)")
        if not infinite and self.num_samples < self.global_batch_size:
            raise DataError(
                f"split {split!r} has {self.num_samples} samples, fewer than one global batch of "
                f"{self.global_batch_size} (lower the batch size or add data)"
            )
        self.consumed = 0  # global samples consumed by all dp ranks together
        self._perms: dict[int, np.ndarray] = {}

    def fetch(self, indices: np.ndarray, positions: np.ndarray):
        """The batch of these sample indices, at these global stream positions (a position
        identifies one visit of a sample: what per-visit randomness, e.g. noise, is keyed by)."""
        raise NotImplementedError

    # -- order ---------------------------------------------------------------------------
    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # a batch touches at most two epochs
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.random.default_rng(self.seed + epoch).permutation(self.num_samples)
        return self._perms[epoch]

    def sample_indices(self, start: int, count: int) -> np.ndarray:
        """Sample indices at global stream positions ``[start, start+count)``."""
        pos = np.arange(start, start + count)
        epochs, within = np.divmod(pos, self.num_samples)
        if not self.shuffle:
            return within
        out = np.empty(count, dtype=np.int64)
        for e in np.unique(epochs):
            m = epochs == e
            out[m] = self._perm(int(e))[within[m]]
        return out

    @property
    def epoch(self) -> int:
        return self.consumed // self.num_samples

    @property
    def calls(self) -> int:
        return self.consumed // self.global_batch_size

    # -- iteration -----------------------------------------------------------------------
    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next local batch; raises ``StopIteration`` at the end of a finite loader."""
        if not self.infinite and self.consumed + self.global_batch_size > self.num_samples:
            raise StopIteration
        start = self.consumed + self.dp_rank * self.local_batch_size
        idx = self.sample_indices(start, self.local_batch_size)
        batch = self.fetch(idx, np.arange(start, start + self.local_batch_size))
        self.consumed += self.global_batch_size
        return batch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next_batch()

    def __len__(self) -> int:
        """Batches per rank in one pass (finite loaders: exactly how many calls succeed)."""
        return self.num_samples // self.global_batch_size

    def reset(self) -> None:
        """Back to the first batch (e.g. before each validation pass)."""
        self.consumed = 0

    # -- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Small, rank-independent state: position in global samples plus what must match."""
        return {
            "version": STATE_VERSION,
            "kind": self.kind,
            "rank_independent": True,  # a checkpoint keeps one copy, loadable under any layout
            "consumed": self.consumed,
            "calls": self.calls,
            "epoch": self.epoch,
            "local_batch_size": self.local_batch_size,
            "dp_degree": self.dp_degree,
            "global_batch_size": self.global_batch_size,
            **{key: getattr(self, key) for key in self.order_keys},
        }

    def load_state_dict(self, sd: dict) -> None:
        """Resume at the saved global position; the dp layout may differ.

        The data order must be the same (split, sample count, seq_len, shuffle, seed),
        otherwise resuming would silently repeat or skip data, so that is an error. A
        different global batch size is accepted: the position is in samples, not calls.
        """
        if not isinstance(sd, dict) or sd.get("kind") != self.kind or sd.get("version") != STATE_VERSION:
            raise DataError(
                f"not a {self.kind} loader state (version {STATE_VERSION}): "
                f"got {type(sd).__name__} with keys {sorted(sd) if isinstance(sd, dict) else '-'}"
            )
        for key in self.order_keys:
            if sd.get(key) != getattr(self, key):
                raise DataError(
                    f"data loader state does not match this data: {key} was {sd.get(key)!r}, now "
                    f"{getattr(self, key)!r} (resume with the same data, seq_len, shuffle and seed)"
                )
        consumed = sd.get("consumed")
        if not isinstance(consumed, int) or consumed < 0:
            raise DataError(f"data loader state has invalid 'consumed'={consumed!r}")
        self.consumed = consumed


class BatchLoader(SampleStream):
    """Batches of ``(inputs, labels)`` [B, seq_len] from a flat packed token array.

    Sample i is ``tokens[i*seq_len : i*seq_len + seq_len + 1]`` (non-overlapping targets).
    """

    kind = "packed"
    order_keys = ("split", "seq_len", "num_samples", "shuffle", "seed")  # seq_len first: it changes num_samples

    def __init__(self, tokens: np.ndarray, seq_len: int, local_batch_size: int, dp_rank: int = 0,
                 dp_degree: int = 1, shuffle: bool = False, seed: int = 0, infinite: bool = True,
                 split: str = "train"):
        self.tokens = tokens
        self.seq_len = int(seq_len)
        num_samples = max(0, (len(tokens) - 1) // self.seq_len)
        if num_samples == 0:
            _check_layout(local_batch_size, dp_rank, dp_degree)
            raise DataError(
                f"split {split!r} has {len(tokens)} tokens, fewer than one sample of seq_len+1={seq_len + 1} "
                "(add data or lower training.seq_len)"
            )
        super().__init__(num_samples, local_batch_size, dp_rank, dp_degree, shuffle, seed, infinite, split)

    def fetch(self, indices: np.ndarray, positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        offsets = indices[:, None] * self.seq_len + np.arange(self.seq_len + 1)[None, :]
        return windows_to_batch(self.tokens[offsets])


class StreamingBatchLoader:
    """Packs an HF ``IterableDataset`` on the fly for one dp rank.

    ``make_dataset()`` must return a fresh, already rank-sharded ``IterableDataset``
    yielding ``{text_field: str}``; ``encode_batch`` tokenizes a list of texts. The state
    is the HF dataset's own ``state_dict()`` (taken when the last document was pulled)
    plus the packed tokens not yet served, so resuming under the same layout is exact.
    """

    def __init__(
        self,
        make_dataset: Callable[[], "object"],
        encode_batch: Callable[[list[str]], list[list[int]]],
        bos_id: int,
        eos_id: int,
        text_field: str,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int = 0,
        dp_degree: int = 1,
        infinite: bool = True,
        split: str = "train",
        chunk_documents: int = 64,
        stats: dict | None = None,
    ):
        _check_layout(local_batch_size, dp_rank, dp_degree)
        self.make_dataset, self.encode_batch = make_dataset, encode_batch
        self.bos_id, self.eos_id, self.text_field = bos_id, eos_id, text_field
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.dp_rank, self.dp_degree, self.infinite, self.split = dp_rank, dp_degree, infinite, split
        self.chunk_documents = chunk_documents
        self.stats = stats if stats is not None else {"documents": {}, "empty_skipped": 0, "tokens": {}}
        self.calls = 0
        self.epoch = 0
        self._buffer: list[int] = []
        self._hf_state = None
        self._epoch_has_tokens = False
        self._start(None)

    def _start(self, hf_state) -> None:
        self._ds = self.make_dataset()
        self._ds.set_epoch(self.epoch)
        if hf_state is not None:
            self._ds.load_state_dict(copy.deepcopy(hf_state))
        self._it = iter(self._ds)
        self._hf_state = copy.deepcopy(self._ds.state_dict())
        self._epoch_has_tokens = hf_state is not None  # a resumed epoch already produced text

    def _pull_documents(self) -> bool:
        """Tokenize up to ``chunk_documents`` more documents into the buffer; False at the end."""
        texts: list[str] = []
        pulled = 0
        for _ in range(self.chunk_documents):
            try:
                rec = next(self._it)
            except StopIteration:
                break
            pulled += 1
            text = rec.get(self.text_field)
            if not is_document(text):
                self.stats["empty_skipped"] = self.stats.get("empty_skipped", 0) + 1
                continue
            texts.append(text)
        self._hf_state = copy.deepcopy(self._ds.state_dict())
        if texts:
            frame(self.encode_batch(texts), self.bos_id, self.eos_id, self._buffer)
        docs = self.stats.setdefault("documents", {})
        docs[self.split] = docs.get(self.split, 0) + len(texts)
        return pulled > 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        need = self.local_batch_size * self.seq_len + 1
        while len(self._buffer) < need:
            before = len(self._buffer)
            if self._pull_documents():
                self._epoch_has_tokens |= len(self._buffer) > before
                continue
            if not self.infinite:
                raise StopIteration
            if not self._epoch_has_tokens:
                raise DataError(f"streaming split {self.split!r} on dp rank {self.dp_rank} yields no text")
            self.epoch += 1
            self._start(None)
        flat = np.asarray(self._buffer[:need], dtype=np.int64)
        del self._buffer[: need - 1]  # the last target token starts the next window
        offsets = np.arange(self.local_batch_size)[:, None] * self.seq_len + np.arange(self.seq_len + 1)[None, :]
        self.calls += 1
        toks = self.stats.setdefault("tokens", {})
        toks[self.split] = toks.get(self.split, 0) + need - 1
        return windows_to_batch(flat[offsets])

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next_batch()

    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            "kind": "streaming",
            "split": self.split,
            "calls": self.calls,
            "epoch": self.epoch,
            "dp_rank": self.dp_rank,
            "dp_degree": self.dp_degree,
            "local_batch_size": self.local_batch_size,
            "seq_len": self.seq_len,
            "hf_state": copy.deepcopy(self._hf_state),
            "buffer": list(self._buffer),
        }

    def load_state_dict(self, sd: dict) -> None:
        if not isinstance(sd, dict) or sd.get("kind") != "streaming" or sd.get("version") != STATE_VERSION:
            raise DataError(f"not a streaming loader state (version {STATE_VERSION})")
        for key in ("split", "dp_rank", "dp_degree", "seq_len"):
            if sd.get(key) != getattr(self, key):
                raise DataError(
                    f"streaming loader state was saved with {key}={sd.get(key)!r}, now {getattr(self, key)!r}; "
                    "streaming data can only resume under the same data-parallel layout and seq_len"
                )
        self.calls, self.epoch = int(sd["calls"]), int(sd["epoch"])
        self._buffer = [int(t) for t in sd["buffer"]]
        self._start(sd["hf_state"])


def iter_chunks(items: Iterable, size: int) -> Iterator[list]:
    """Consecutive lists of up to ``size`` items."""
    chunk: list = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _join(parts: list):
    if isinstance(parts[0], dict):
        return {k: _join([p[k] for p in parts]) for k in parts[0]}
    return torch.cat(parts)


def joined_batches(loaders: list) -> Iterator:
    """The i-th batches of several loaders as one batch (inputs and labels concatenated), until
    one ends: a torchft replica group validates on every group's slice, so its validation loss
    is the whole data-parallel world's (what a DDP run of all the groups' ranks reports)."""
    for batches in zip(*loaders):
        yield _join([b[0] for b in batches]), _join([b[1] for b in batches])
