"""One reader per data source: where a split's documents come from, and what identifies them.

A ``DocumentReader`` gives, per split, its documents a list at a time (``chunks``: what
``packing.py`` turns into a token stream) or a fresh HF ``IterableDataset`` of ``{text_field: str}``
records (``stream``: what the streaming loader packs on the fly), and ``key()``, the material of
the token cache's key. ``make_reader`` picks the reader of ``data.source``; a prepared corpus is
already a token stream (``read_prepared``).

Sources:
  builtin   the Python standard library's sources (``corpus.py``); val = held-out files
  json      local JSON-lines / JSON files (``path`` = file, directory or glob)
  parquet   local parquet files
  text      local text files, one document per blank-line-separated paragraph
  hf        a hub dataset ``hf_name``/``hf_config`` (e.g. allenai/c4 en, streaming)
  prepared  a corpus tokenized once by ``recipes/prepare_data.py``: its memory-mapped shards
            are read in place, at any size (``shards.py``)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

from titan_hydra.data import corpus
from titan_hydra.data.files import check_files, file_fingerprint, resolve_files
from titan_hydra.data.loader import iter_chunks
from titan_hydra.data.packing import SPLITS, TokenSplits
from titan_hydra.data.shards import ShardedTokens, read_manifest
from titan_hydra.data.tokenizer import Tokenizer
from titan_hydra.errors import DataError, first_line

ENCODE_CHUNK = 256  # documents per encode_batch call: parallel in Rust, bounded memory

Chunks = Iterator[list]


class DocumentReader:
    """The documents of one source, per split ("train", "val")."""

    def key(self) -> dict[str, Any]:
        """What identifies the documents (files and their sizes and mtimes, a dataset's fingerprint)."""
        raise NotImplementedError

    def chunks(self, split: str) -> Chunks:
        """The split's texts, ENCODE_CHUNK at a time (a text may be empty or None: packing skips it)."""
        raise NotImplementedError

    def stream(self, split: str) -> Callable[[], Any]:
        """A factory of the split as a fresh HF ``IterableDataset`` (streaming sources only)."""
        raise NotImplementedError


class BuiltinReader(DocumentReader):
    """The standard library's sources; ``max_documents`` caps each split."""

    def __init__(self, max_documents: int | None):
        self.max_documents = max_documents

    def key(self) -> dict[str, Any]:
        return {s: corpus.builtin_fingerprint(s) for s in SPLITS}

    def chunks(self, split: str) -> Chunks:
        return iter_chunks(corpus.builtin_documents(split, self.max_documents), ENCODE_CHUNK)

    def stream(self, split: str) -> Callable[[], Any]:
        raise DataError("data.streaming=true is not supported for the builtin corpus (it is small)")


class MapStyleSplits:
    """Train/val texts of map-style HF datasets: val from its own data, else the last
    ``val_fraction`` of the (``max_documents``-capped) train documents."""

    def __init__(self, load_train: Callable, load_val: Callable | None, text_field: str,
                 val_fraction: float, max_documents: int | None):
        self.load_train, self.load_val, self.field = load_train, load_val, text_field
        self.val_fraction, self.max_documents = val_fraction, max_documents
        self._train = None

    def train(self):
        if self._train is None:
            ds = self.load_train()
            if self.max_documents is not None:
                ds = ds.select(range(min(self.max_documents, len(ds))))
            self._train = ds
        return self._train

    def _rows(self, ds, lo: int, hi: int) -> Chunks:
        for start in range(lo, hi, ENCODE_CHUNK):
            yield ds[start: min(hi, start + ENCODE_CHUNK)][self.field]

    def chunks(self, split: str) -> Chunks:
        if self.load_val is not None:
            ds = self.train() if split == "train" else self.load_val()
            return self._rows(ds, 0, len(ds))
        n = len(self.train())
        n_val = int(round(n * self.val_fraction)) if n > 1 else 0
        return self._rows(self.train(), 0, n - n_val) if split == "train" else self._rows(self.train(), n - n_val, n)


def load_local(source: str, files: list[str], text_field: str, hf_cache: str, streaming: bool = False):
    """Local json/parquet/text files as one HF dataset (checked first: ``files.check_files``)."""
    import datasets  # heavy: only sources that read through HF datasets pay for it

    check_files(files, source, text_field, streaming)
    kwargs = {"sample_by": "paragraph", "keep_linebreaks": True} if source == "text" else {}
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # one bar per rank per file is noise
    try:
        ds = datasets.load_dataset(source, data_files=files, split="train", streaming=streaming,
                                   cache_dir=hf_cache, **kwargs)
    except Exception as e:  # datasets wraps parse errors in several exception types
        raise DataError(f"could not load {source} files {files[:3]}: {first_line(e)}") from None
    finally:
        if bars:
            datasets.enable_progress_bars()
    if not streaming and text_field not in ds.column_names:
        raise DataError(
            f"bad records in {files[0]}: missing text field {text_field!r}; columns are "
            f"{ds.column_names} (set data.text_field=...)"
        )
    return ds


@dataclass(frozen=True)
class SplitSettings:
    """How a map-style reader finds and splits its documents (the ``data`` keys of those names)."""

    val_path: str | None
    text_field: str
    val_fraction: float
    max_documents: int | None
    hf_cache: str  # where HF datasets keeps what it downloads and converts


class MapStyleReader(DocumentReader):
    """A reader whose ``key()`` opens its splits as map-style HF datasets (``MapStyleSplits``)."""

    def __init__(self, settings: SplitSettings):
        self.settings = settings
        self.val_path, self.text_field = settings.val_path, settings.text_field
        self._splits: MapStyleSplits | None = None

    def _open(self, load_train: Callable, load_val: Callable | None) -> None:
        s = self.settings
        self._splits = MapStyleSplits(load_train, load_val, s.text_field, s.val_fraction, s.max_documents)

    def chunks(self, split: str) -> Chunks:
        if self._splits is None:
            self.key()
        return self._splits.chunks(split)


class LocalReader(MapStyleReader):
    """json, parquet or text files at ``path`` (val: ``val_path``'s files, else a fraction)."""

    def __init__(self, source: str, path: str, settings: SplitSettings):
        super().__init__(settings)
        self.source, self.path = source, path

    def _load(self, files: list[str], streaming: bool = False):
        return load_local(self.source, files, self.text_field, self.settings.hf_cache, streaming)

    def key(self) -> dict[str, Any]:
        files = resolve_files(self.path, self.source)
        val_files = resolve_files(self.val_path, self.source, "data.val_path") if self.val_path else None
        self._open(lambda: self._load(files), (lambda: self._load(val_files)) if val_files else None)
        return {"files": file_fingerprint(files), "val_files": val_files and file_fingerprint(val_files)}

    def stream(self, split: str) -> Callable[[], Any]:
        files = resolve_files(self.path if split == "train" else self.val_path, self.source)
        return lambda: self._load(files, streaming=True)


class HubReader(MapStyleReader):
    """A hub dataset (or a local dataset directory) by name; ``val_path`` is a split name of it."""

    def __init__(self, name: str, config: str | None, settings: SplitSettings):
        super().__init__(settings)
        self.name, self.config = name, config

    def _load(self, split: str, streaming: bool):
        import datasets  # heavy: only sources that read through HF datasets pay for it

        try:
            return datasets.load_dataset(self.name, self.config, split=split, streaming=streaming,
                                         cache_dir=self.settings.hf_cache)
        except Exception as e:
            raise DataError(
                f"could not load hub dataset {self.name} ({self.config}) split {split}: {first_line(e)}"
            ) from None

    def key(self) -> dict[str, Any]:
        ds = self._load("train", streaming=False)
        key = {"hf": [self.name, self.config, getattr(ds, "_fingerprint", None)]}
        val_ds = self._load(self.val_path, streaming=False) if self.val_path else None
        if val_ds is not None:
            key["hf_val"] = [self.val_path, getattr(val_ds, "_fingerprint", None)]
        self._open(lambda: ds, (lambda: val_ds) if val_ds is not None else None)
        return key

    def stream(self, split: str) -> Callable[[], Any]:
        hf_split = "train" if split == "train" else self.val_path
        return lambda: self._load(hf_split, streaming=True)


def make_reader(source: str, path: str | None, hf_name: str | None, hf_config: str | None,
                settings: SplitSettings) -> DocumentReader:
    """The reader of ``data.source`` (any source but prepared)."""
    if source == "builtin":
        return BuiltinReader(settings.max_documents)
    if source == "hf":
        return HubReader(hf_name, hf_config, settings)
    return LocalReader(source, path, settings)


def read_prepared(path: str, tokenizer: Tokenizer) -> TokenSplits:
    """A prepared corpus's splits, read in place; it must have been made with ``tokenizer``."""
    meta = read_manifest(path)
    made_with = meta["tokenizer"]
    if made_with["hash"] != tokenizer.content_hash:
        raise DataError(f"data.path={path} was prepared with tokenizer {made_with['name']!r}, which differs "
                        f"from data.tokenizer={tokenizer.path}; set data.tokenizer={made_with['name']} or "
                        "prepare the corpus again with this one")
    out = TokenSplits({}, cache_key=made_with["hash"][:24], cache_hit=True)
    for split in SPLITS:
        out.tokens[split] = ShardedTokens(path, split, meta)
        out.stats["tokens"][split] = len(out.tokens[split])
        out.stats["documents"][split] = out.tokens[split].documents
    return out
