"""Token datasets: documents from a source -> one packed token stream per split.

Sources (``source=``):
  builtin   the Python standard library's sources (``corpus.py``); val = held-out files
  json      local JSON-lines / JSON files (``path`` = file, directory or glob)
  parquet   local parquet files
  text      local text files, one document per blank-line-separated paragraph
  hf        a hub dataset ``hf_name``/``hf_config`` (e.g. allenai/c4 en, streaming)
  prepared  a corpus tokenized once by ``recipes/prepare_data.py`` (``path`` = its directory): its
            memory-mapped shards are read in place, at any size (``shards.py``)

Packing: every document becomes ``[bos] + tokens + [eos]``; the documents of a split are
concatenated into one flat int32 array and sample i is the window
``tokens[i*seq_len : i*seq_len + seq_len + 1]`` (inputs = w[:-1], labels = w[1:]).
The arrays are cached as ``.npy`` keyed by everything that determines them, so every
rank after the first and every later run skips tokenization.

Streaming (``streaming=True``) never materialises the data: documents are sharded across
dp ranks and packed on the fly (``StreamingBatchLoader``), which is resumable under the
same layout but, unlike the packed path, not identical across dp layouts.
"""

from __future__ import annotations

import glob as _glob
import gzip
import hashlib
import json
import os
import tempfile
import zlib
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from titan_hydra.data import corpus
from titan_hydra.data.documents import json_texts
from titan_hydra.errors import DataError, first_line
from titan_hydra.data.loader import BatchLoader, StreamingBatchLoader, iter_chunks
from titan_hydra.data.shards import ShardedTokens, read_manifest
from titan_hydra.data.tokenizer import Tokenizer

SOURCES = ("builtin", "json", "parquet", "text", "hf", "prepared")
SPLITS = ("train", "val")
EXTENSIONS = {
    "json": (".jsonl", ".json", ".jsonl.gz", ".json.gz"),
    "parquet": (".parquet",),
    "text": (".txt", ".text", ".md"),
}
CACHE_VERSION = 1
TEXT_PROBE_BYTES = 1 << 16  # how much of a streamed file check_text_file reads
ENCODE_CHUNK = 256  # documents per encode_batch call: parallel in Rust, bounded memory


def default_cache_dir() -> Path:
    return Path(os.environ.get("TITAN_HYDRA_CACHE", Path.home() / ".cache" / "titan_hydra"))


def resolve_files(path: str, source: str, what: str = "data.path") -> list[str]:
    """A file, a directory (its files with the source's extensions, recursively) or a glob."""
    p = Path(path).expanduser()
    if p.is_file():
        return [str(p)]
    if p.is_dir():
        files = [str(f) for f in p.rglob("*") if f.is_file() and f.name.endswith(EXTENSIONS[source])]
    else:
        files = [f for f in _glob.glob(str(p), recursive=True) if os.path.isfile(f)]
    if not files:
        raise DataError(
            f"no {source} files found at {what}={path} (give a file, a directory of "
            f"{'/'.join(EXTENSIONS[source])} files, or a glob)"
        )
    return sorted(files)


def check_text_file(path: str, whole: bool = True) -> None:
    """Refuse an empty, binary or non-UTF-8 json/text data file, naming it and the first bad byte.

    HF ``datasets`` reports such a file as "An error occurred while generating the dataset" (or
    not at all: an empty file is zero documents and the run fails later, on an empty split).
    ``whole=False`` (streamed data, possibly huge) reads only the first TEXT_PROBE_BYTES.
    """
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, empty = 0, True
    try:
        opener = gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")
        with opener as f:
            while True:
                block = f.read(1 << 20 if whole else TEXT_PROBE_BYTES)
                if not block:
                    break
                empty = empty and not block.strip()
                nul = block.find(b"\0")
                if nul >= 0:
                    raise DataError(f"data file {path} is binary (a NUL byte at offset {offset + nul}); "
                                    "json/text sources need UTF-8 text")
                try:
                    decoder.decode(block)
                except UnicodeDecodeError as e:
                    raise DataError(f"data file {path} is not UTF-8 text (invalid byte at offset "
                                    f"{offset + e.start}); convert it to UTF-8") from None
                offset += len(block)
                if not whole:
                    break
            if whole:
                try:
                    decoder.decode(b"", final=True)  # a character cut off at the end of the file
                except UnicodeDecodeError:
                    raise DataError(f"data file {path} is not UTF-8 text (it ends inside a character)") from None
    except (OSError, EOFError, zlib.error) as e:  # unreadable, a .gz that is not gzip or is cut short
        raise DataError(f"data file {path} cannot be read ({first_line(e)})") from None
    if empty:
        raise DataError(f"data file {path} is empty (no text); remove it or point data.path elsewhere")


def validate_json_file(path: str, text_field: str) -> None:
    """Scan a JSON-lines (or JSON array) file and name the first bad record by line number.

    HF ``datasets`` reports malformed JSON without a line number; this cheap pass makes
    the error actionable. It runs only when tokens are not already cached.
    """
    for _ in json_texts(path, text_field):
        pass


def _file_fingerprint(files: list[str]) -> list:
    return [[os.path.abspath(f), os.path.getsize(f), os.stat(f).st_mtime_ns] for f in files]


def _atomic_save(path: Path, array: np.ndarray) -> None:
    """Write then rename, so concurrent ranks never read a half-written cache file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


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
        if source not in SOURCES:
            raise DataError(f"unknown data.source={source!r}; choose one of {', '.join(SOURCES)}")
        if source in ("json", "parquet", "text") and not path:
            raise DataError(f"data.source={source} needs data.path (a file, a directory or a glob)")
        if source == "prepared" and (not path or streaming):
            raise DataError("data.source=prepared needs data.path (a directory recipes/prepare_data.py wrote) "
                            "and data.streaming=false (its shards are read in place)")
        if source == "hf" and not hf_name:
            raise DataError("data.source=hf needs data.hf_name (e.g. allenai/c4)")
        if source == "builtin" and streaming:
            raise DataError("data.streaming=true is not supported for the builtin corpus (it is small)")
        if seq_len < 1:
            raise DataError(f"data.seq_len must be >= 1, got {seq_len}")
        if not 0.0 <= val_fraction < 1.0:
            raise DataError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
        self.source, self.path, self.val_path = source, path, val_path
        self.seq_len, self.text_field = int(seq_len), ("text" if source == "text" else text_field)
        self.val_fraction, self.shuffle, self.seed = val_fraction, shuffle, seed
        self.hf_name, self.hf_config, self.streaming = hf_name, hf_config, streaming
        self.max_documents = max_documents
        self.document_mask = bool(document_mask)
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        self.tokenizer = Tokenizer(tokenizer)
        self.vocab_size = self.tokenizer.vocab_size
        self.stats: dict = {"documents": {}, "empty_skipped": 0, "tokens": {}}
        self.cache_hit = False
        self.cache_key: str | None = None
        self._tokens: dict[str, np.ndarray] = {}
        if source == "prepared":
            self._open_prepared()
        elif not streaming:
            self._build()

    @property
    def document_eos_id(self) -> int | None:
        """The token that ends a packed document when ``document_mask`` is on (None: off): the
        model's attention then stays inside documents (``models/common/masking.py``)."""
        return self.tokenizer.eos_id if self.document_mask else None

    # -- documents -----------------------------------------------------------------------
    def _hf_cache(self) -> str:
        return str(self.cache_dir / "hf_datasets")

    def _load_local(self, files: list[str], streaming: bool = False):
        import datasets

        for f in files:
            if self.source in ("json", "text"):
                check_text_file(f, whole=not streaming)
            elif os.path.getsize(f) == 0:
                raise DataError(f"data file {f} is empty (0 bytes); remove it or point data.path elsewhere")
            if self.source == "json" and not streaming:
                validate_json_file(f, self.text_field)
        kwargs = {"sample_by": "paragraph", "keep_linebreaks": True} if self.source == "text" else {}
        bars = datasets.is_progress_bar_enabled()
        datasets.disable_progress_bars()  # one bar per rank per file is noise
        try:
            ds = datasets.load_dataset(
                self.source, data_files=files, split="train", streaming=streaming,
                cache_dir=self._hf_cache(), **kwargs,
            )
        except Exception as e:  # datasets wraps parse errors in several exception types
            raise DataError(f"could not load {self.source} files {files[:3]}: {first_line(e)}") from None
        finally:
            if bars:
                datasets.enable_progress_bars()
        if not streaming and self.text_field not in ds.column_names:
            raise DataError(
                f"bad records in {files[0]}: missing text field {self.text_field!r}; columns are "
                f"{ds.column_names} (set data.text_field=...)"
            )
        return ds

    def _load_hub(self, split: str, streaming: bool):
        import datasets

        try:
            return datasets.load_dataset(
                self.hf_name, self.hf_config, split=split, streaming=streaming, cache_dir=self._hf_cache()
            )
        except Exception as e:
            raise DataError(
                f"could not load hub dataset {self.hf_name} ({self.hf_config}) split {split}: "
                f"{first_line(e)}"
            ) from None

    def _doc_sources(self) -> tuple[dict, dict[str, Callable[[], Iterator[list[str]]]]]:
        """(cache-key material, split -> factory of text chunks) for a non-streaming source."""
        if self.source == "builtin":
            key = {s: corpus.builtin_fingerprint(s) for s in SPLITS}
            return key, {
                s: (lambda s=s: iter_chunks(corpus.builtin_documents(s, self.max_documents), ENCODE_CHUNK))
                for s in SPLITS
            }
        if self.source == "hf":
            ds = self._load_hub("train", streaming=False)
            key = {"hf": [self.hf_name, self.hf_config, getattr(ds, "_fingerprint", None)]}
            val_ds = self._load_hub(self.val_path, streaming=False) if self.val_path else None
            if val_ds is not None:
                key["hf_val"] = [self.val_path, getattr(val_ds, "_fingerprint", None)]
            return key, self._split_map_style(lambda: ds, (lambda: val_ds) if val_ds is not None else None)
        files = resolve_files(self.path, self.source)
        val_files = resolve_files(self.val_path, self.source, "data.val_path") if self.val_path else None
        key = {"files": _file_fingerprint(files), "val_files": val_files and _file_fingerprint(val_files)}
        return key, self._split_map_style(
            lambda: self._load_local(files), (lambda: self._load_local(val_files)) if val_files else None
        )

    def _split_map_style(self, load_train, load_val):
        """Train/val chunk factories: ``val`` from its own data, else the last fraction of docs."""
        field = self.text_field
        cache: dict = {}

        def train_ds():
            if "train" not in cache:
                ds = load_train()
                if self.max_documents is not None:
                    ds = ds.select(range(min(self.max_documents, len(ds))))
                cache["train"] = ds
            return cache["train"]

        def chunks(ds, lo, hi):
            for start in range(lo, hi, ENCODE_CHUNK):
                yield ds[start : min(hi, start + ENCODE_CHUNK)][field]

        def n_val(n):
            return int(round(n * self.val_fraction)) if n > 1 else 0

        if load_val is not None:
            def val():
                ds = load_val()
                return chunks(ds, 0, len(ds))
            return {"train": lambda: chunks(train_ds(), 0, len(train_ds())), "val": val}
        return {
            "train": lambda: chunks(train_ds(), 0, len(train_ds()) - n_val(len(train_ds()))),
            "val": lambda: chunks(train_ds(), len(train_ds()) - n_val(len(train_ds())), len(train_ds())),
        }

    # -- packing + cache -----------------------------------------------------------------
    def _pack(self, text_chunks) -> tuple[np.ndarray, int, int]:
        """-> (flat int32 tokens, documents kept, empty documents skipped)."""
        bos, eos = self.tokenizer.bos_id, self.tokenizer.eos_id
        parts, docs, empty = [], 0, 0
        for texts in text_chunks:
            kept = [t for t in texts if isinstance(t, str) and t.strip()]
            empty += len(texts) - len(kept)
            if not kept:
                continue
            buf: list[int] = []
            for ids in self.tokenizer.encode_batch(kept):
                buf.append(bos)
                buf.extend(ids)
                buf.append(eos)
            parts.append(np.array(buf, dtype=np.int32))
            docs += len(kept)
        flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
        return flat, docs, empty

    def _build(self) -> None:
        key_material, factories = self._doc_sources()
        key_material.update(
            version=CACHE_VERSION, source=self.source, tokenizer=self.tokenizer.content_hash,
            text_field=self.text_field, val_fraction=self.val_fraction, val_path=self.val_path,
            max_documents=self.max_documents,
        )
        self.cache_key = hashlib.sha256(json.dumps(key_material, sort_keys=True).encode()).hexdigest()[:24]
        base = self.cache_dir / f"tokens-{self.source}-{self.cache_key}"
        meta_path = Path(f"{base}.json")
        paths = {s: Path(f"{base}-{s}.npy") for s in SPLITS}
        if meta_path.is_file() and all(p.is_file() for p in paths.values()):
            try:
                meta = json.loads(meta_path.read_text())
                self._tokens = {s: np.load(p, mmap_mode="r") for s, p in paths.items()}
                self.stats.update(meta["stats"])
                self.cache_hit = True
                return
            except (ValueError, KeyError, OSError):
                pass  # unreadable cache: rebuild it
        self._check_cache_writable()  # before tokenizing: the result must be storable
        for split in SPLITS:
            flat, docs, empty = self._pack(factories[split]())
            self._tokens[split] = flat
            self.stats["documents"][split] = docs
            self.stats["empty_skipped"] += empty
            self.stats["tokens"][split] = int(flat.size)
        for split in SPLITS:
            _atomic_save(paths[split], self._tokens[split])
        _atomic_write_text(meta_path, json.dumps({"stats": self.stats, "key": key_material}, indent=1))

    def _open_prepared(self) -> None:
        meta = read_manifest(self.path)
        made_with = meta["tokenizer"]
        if made_with["hash"] != self.tokenizer.content_hash:
            raise DataError(f"data.path={self.path} was prepared with tokenizer {made_with['name']!r}, which differs "
                            f"from data.tokenizer={self.tokenizer.path}; set data.tokenizer={made_with['name']} or "
                            "prepare the corpus again with this one")
        for split in SPLITS:
            self._tokens[split] = ShardedTokens(self.path, split, meta)
            self.stats["tokens"][split] = len(self._tokens[split])
            self.stats["documents"][split] = self._tokens[split].documents
        self.cache_key = made_with["hash"][:24]
        self.cache_hit = True

    def _check_cache_writable(self) -> None:
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=self.cache_dir):
                pass
        except OSError as e:
            raise DataError(
                f"token cache {self.cache_dir} is not writable ({first_line(e)}); set data.cache_dir (or "
                "TITAN_HYDRA_CACHE) to a writable directory"
            ) from None

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
        self, split: str, local_batch_size: int, dp_rank: int = 0, dp_degree: int = 1, infinite: bool = True
    ):
        """A stateful loader for this dp rank; "val" is never shuffled."""
        if split not in SPLITS:
            raise DataError(f"unknown split {split!r}; expected one of {SPLITS}")
        if self.streaming:
            return self._streaming_loader(split, local_batch_size, dp_rank, dp_degree, infinite)
        return BatchLoader(
            self.tokens(split), self.seq_len, local_batch_size, dp_rank, dp_degree,
            shuffle=self.shuffle and split == "train", seed=self.seed, infinite=infinite, split=split,
        )

    def _streaming_loader(self, split, local_batch_size, dp_rank, dp_degree, infinite):
        from datasets.distributed import split_dataset_by_node

        if split == "val" and not self.val_path:
            raise DataError("a streaming dataset needs data.val_path for validation (hf: a split name)")
        if self.source == "hf":
            hf_split = "train" if split == "train" else self.val_path

            def load():
                return self._load_hub(hf_split, streaming=True)
        else:
            files = resolve_files(self.path if split == "train" else self.val_path, self.source)

            def load():
                return self._load_local(files, streaming=True)

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
