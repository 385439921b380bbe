"""Token datasets: documents from a source -> one packed token stream per split.

``TokenDataset`` composes three pieces, each in its own module:

* a reader per source (``readers.py``): a split's documents and what identifies them; a
  prepared corpus (``recipes/prepare_data.py``) is read in place as tokens;
* packing (``packing.py``): every document becomes ``[bos] + tokens + [eos]``, the documents of a
  split one flat int32 array, sample i the window ``tokens[i*seq_len : i*seq_len + seq_len + 1]``
  (inputs = w[:-1], labels = w[1:]);
* the token cache (``token_cache.py``): packed splits as ``.npy`` keyed by everything that
  determines them, so every rank after the first and every later run skips tokenization.

Streaming (``streaming=True``) never materialises the data: documents are sharded across
dp ranks and packed on the fly (``StreamingBatchLoader``), which is resumable under the
same layout but, unlike the packed path, not identical across dp layouts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from titan_hydra.data.files import resolve_files as resolve_files  # what recipes/prepare_data.py imports
from titan_hydra.data.loader import BatchLoader, StreamingBatchLoader
from titan_hydra.data.packing import SPLITS, TokenSplits, pack_splits
from titan_hydra.data.readers import DocumentReader, SplitSettings, make_reader, read_prepared
from titan_hydra.data.token_cache import CACHE_VERSION, TokenCache, default_cache_dir
from titan_hydra.data.tokenizer import Tokenizer
from titan_hydra.errors import DataError

SOURCES = ("builtin", "json", "parquet", "text", "hf", "prepared")


LOCAL_FILE_SOURCES = ("json", "parquet", "text")  # read from data.path: a file, a directory or a glob


def check_settings(source: str, path: str | None, seq_len: int, val_fraction: float, hf_name: str | None,
                   streaming: bool) -> None:
    """One-line DataError for settings no reader can serve, before anything is read. Every data
    source rule lives here: ``validate`` calls it before any process starts (the schema's Choice
    has already refused an unknown source there), and ``TokenDataset`` calls it for a direct build."""
    if source not in SOURCES:
        raise DataError(f"unknown data.source={source!r}; choose one of {', '.join(SOURCES)}")
    if source in LOCAL_FILE_SOURCES:
        _check_local_path(source, path)
    if source == "prepared":
        _check_prepared(path, streaming)
    if source == "hf" and not hf_name:
        raise DataError("data.source=hf needs data.hf_name (e.g. allenai/c4)")
    if source == "builtin" and streaming:
        raise DataError("data.streaming=true is not supported for the builtin corpus (it is small); "
                        "set data.streaming=false")
    if seq_len < 1:
        raise DataError(f"data.seq_len={seq_len} must be >= 1")
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"data.val_fraction={val_fraction} must be within [0, 1)")


def _check_local_path(source: str, path: str | None) -> None:
    """A file source needs a path; one without a glob pattern must exist (a glob may match later files)."""
    if not path:
        raise DataError(f"data.source={source} needs a file: set data.path=<file, directory or glob>")
    if not any(ch in path for ch in "*?[") and not Path(path).expanduser().exists():
        raise DataError(f"data.path={path} does not exist; give a file, a directory or a glob")


def _check_prepared(path: str | None, streaming: bool) -> None:
    """A prepared corpus is a directory of shards read in place (memory-mapped), never streamed."""
    if not path or not Path(path).expanduser().is_dir():
        raise DataError(f"data.source=prepared needs data.path=<a directory recipes/prepare_data.py wrote>; "
                        f"{path or '?'} is not one")
    if streaming:
        raise DataError("data.streaming=true cannot read data.source=prepared (its shards are read in place); "
                        "set data.streaming=false")


class TokenDataset:
    """Packed token splits ("train", "val") of one source, plus loaders over them.

    Instantiated by Hydra from the ``data`` config group. ``max_documents`` caps the
    documents read per split for ``builtin`` and before the train/val split otherwise.
    For ``text`` files ``text_field`` is ignored (the loader's column is always "text").
    For ``builtin`` the validation split is always the held-out files (``val_fraction``
    is unused); for ``hf`` ``val_path`` is a split name of the same hub dataset.
    With ``streaming`` (local json/parquet/text or hf) ``val_path`` names the validation
    data: a hub split name (e.g. "validation") for hf, local files otherwise; there is no
    fraction-based split and ``shuffle`` is ignored so that resumption stays exact.
    """

    def __init__(
        self,
        source: str = "builtin",
        path: str | None = None,
        tokenizer: str = "builtin",
        seq_len: int = 256,
        text_field: str = "text",
        val_path: str | None = None,
        val_fraction: float = 0.05,
        shuffle: bool = True,
        seed: int = 0,
        hf_name: str | None = None,
        hf_config: str | None = None,
        streaming: bool = False,
        max_documents: int | None = None,
        cache_dir: str | None = None,
        document_mask: bool = False,
    ):
        check_settings(source, path, seq_len, val_fraction, hf_name, streaming)
        self.source, self.path, self.val_path = source, path, val_path
        self.seq_len, self.text_field = int(seq_len), ("text" if source == "text" else text_field)
        self.val_fraction, self.shuffle, self.seed = val_fraction, shuffle, seed
        self.hf_name, self.hf_config, self.streaming = hf_name, hf_config, streaming
        self.max_documents = max_documents
        self.document_mask = bool(document_mask)
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        self.tokenizer = Tokenizer(tokenizer)
        self.vocab_size = self.tokenizer.vocab_size
        self.reader: DocumentReader | None = None
        splits = TokenSplits({})
        if source == "prepared":
            splits = read_prepared(self.path, self.tokenizer)
        else:
            settings = SplitSettings(val_path, self.text_field, val_fraction, max_documents,
                                     str(self.cache_dir / "hf_datasets"))
            self.reader = make_reader(source, path, hf_name, hf_config, settings)
            if not streaming:
                splits = self._packed(self.reader)
        self._tokens = splits.tokens
        self.stats: dict = splits.stats
        self.cache_key, self.cache_hit = splits.cache_key, splits.cache_hit

    def _packed(self, reader: DocumentReader) -> TokenSplits:
        """The splits from the cache, or packed from the reader's documents and stored there."""
        material = reader.key()
        material.update(
            version=CACHE_VERSION, source=self.source, tokenizer=self.tokenizer.content_hash,
            text_field=self.text_field, val_fraction=self.val_fraction, val_path=self.val_path,
            max_documents=self.max_documents,
        )
        cache = TokenCache(self.cache_dir, self.source, material)
        cached = cache.load()
        if cached is not None:
            return cached
        cache.check_writable()
        return cache.save(pack_splits(reader.chunks, self.tokenizer))

    @property
    def document_eos_id(self) -> int | None:
        """The token that ends a packed document when ``document_mask`` is on (None: off): the
        model's attention then stays inside documents (``models/common/masking.py``)."""
        return self.tokenizer.eos_id if self.document_mask else None

    # -- public --------------------------------------------------------------------------
    def tokens(self, split: str) -> np.ndarray:
        """The flat packed token array of ``split`` (packed sources only)."""
        if self.streaming:
            raise DataError("a streaming dataset has no token array; use loader()")
        if split not in SPLITS:
            raise DataError(f"unknown split {split!r}; expected one of {SPLITS}")
        return self._tokens[split]

    def num_samples(self, split: str) -> int:
        """Windows of seq_len+1 tokens at stride seq_len: (tokens - 1) // seq_len."""
        return max(0, (len(self.tokens(split)) - 1) // self.seq_len)

    def sample(self, split: str, i: int) -> tuple[np.ndarray, np.ndarray]:
        w = np.asarray(self.tokens(split)[i * self.seq_len : i * self.seq_len + self.seq_len + 1])
        return w[:-1], w[1:]

    def loader(
        self, split: str, local_batch_size: int, dp_rank: int = 0, dp_degree: int = 1, infinite: bool = True,
        seq_len: int | None = None,
    ):
        """A stateful loader for this dp rank; "val" is never shuffled. ``seq_len``: windows of
        another length than ``data.seq_len`` (a seq-len schedule's stage; packed data only)."""
        if split not in SPLITS:
            raise DataError(f"unknown split {split!r}; expected one of {SPLITS}")
        if self.streaming:
            return self._streaming_loader(split, local_batch_size, dp_rank, dp_degree, infinite)
        return BatchLoader(
            self.tokens(split), seq_len or self.seq_len, local_batch_size, dp_rank, dp_degree,
            shuffle=self.shuffle and split == "train", seed=self.seed, infinite=infinite, split=split,
        )

    def _streaming_loader(self, split, local_batch_size, dp_rank, dp_degree, infinite):
        from datasets.distributed import split_dataset_by_node  # heavy: only streaming runs need it

        if split == "val" and not self.val_path:
            raise DataError("a streaming dataset needs data.val_path for validation (hf: a split name)")
        load = self.reader.stream(split)

        def make_dataset():
            ds = load()
            if self.max_documents is not None:
                ds = ds.take(self.max_documents)
            return split_dataset_by_node(ds, rank=dp_rank, world_size=dp_degree)

        return StreamingBatchLoader(
            make_dataset, self.tokenizer.encode_batch, self.tokenizer.bos_id, self.tokenizer.eos_id,
            self.text_field, self.seq_len, local_batch_size, dp_rank, dp_degree, infinite=infinite,
            split=split, stats=self.stats,
        )

    def __repr__(self) -> str:
        return (
            f"TokenDataset(source={self.source!r}, seq_len={self.seq_len}, vocab_size={self.vocab_size}, "
            f"stats={self.stats}, cache_hit={self.cache_hit})"
        )
