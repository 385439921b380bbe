"""Prepared token shards: the on-disk form of a corpus tokenized once (``recipes/prepare_data.py``).

Layout of a prepared directory::

    manifest.json            written last: its presence means the preparation is complete
    train/000003-0001.bin    raw little-endian tokens (uint16 when the vocab fits, else uint32),
    train/000003-0001.docs.npy   and the offsets where its documents start
    val/...
    done/000003.json         one per input file: the shards it produced (resume after a kill)

Shard names carry the index of their input file (sorted order), so the token order is the
same whatever the number of workers, and a file's shards are replaced as a whole: they are
written under temporary names and renamed only when the file is finished, then its ``done``
record is written. Every document is ``[bos] + tokens + [eos]``, as on the packed path.

``ShardedTokens`` reads one split as a single flat token sequence without loading it: every
shard is memory-mapped, and an index array is answered shard by shard, so a loader has random
access at any corpus size.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from titan_hydra.errors import DataError
from titan_hydra.version import project_version

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
SPLITS = ("train", "val")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab <= 65,536), else uint32: half the disk and page cache."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def write_json_atomic(path: Path, payload: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclass
class ShardBuffer:
    """The tokens of one split of one input file, cut into shards of at most ``shard_tokens``."""

    out: Path
    split: str
    file_index: int
    dtype: np.dtype
    shard_tokens: int

    def __post_init__(self) -> None:
        # One growing array of the shard's tokens (no per-document arrays, no concatenation at
        # flush): a worker holds at most about one shard per split, whatever the corpus size.
        self.buffer = np.empty(0, dtype=self.dtype)
        self.doc_starts: list[int] = []
        self.size = 0
        self.written: list[dict[str, Any]] = []

    def add(self, doc: list[int]) -> None:
        self.doc_starts.append(self.size)
        end = self.size + len(doc)
        if end > len(self.buffer):
            grown = np.empty(max(end, min(2 * len(self.buffer), self.shard_tokens), 1 << 16), dtype=self.dtype)
            grown[: self.size] = self.buffer[: self.size]
            self.buffer = grown
        self.buffer[self.size:end] = doc
        self.size = end
        if self.size >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        """Write what is buffered as the next shard (temporary name until ``commit``)."""
        if not self.size:
            return
        name = f"{self.split}/{self.file_index:06d}-{len(self.written):04d}"
        (self.out / self.split).mkdir(parents=True, exist_ok=True)
        self.buffer[: self.size].tofile(self.out / f"{name}.bin.tmp")
        with open(self.out / f"{name}.docs.npy.tmp", "wb") as f:
            np.save(f, np.asarray(self.doc_starts, dtype=np.int64))
        self.written.append({"file": f"{name}.bin", "tokens": int(self.size), "documents": len(self.doc_starts)})
        self.doc_starts, self.size = [], 0

    def commit(self) -> list[dict[str, Any]]:
        """Flush, then give every shard of this file its final name."""
        self.flush()
        for shard in self.written:
            stem = shard["file"][: -len(".bin")]
            for suffix in (".bin", ".docs.npy"):
                os.replace(self.out / f"{stem}{suffix}.tmp", self.out / f"{stem}{suffix}")
        return self.written


def remove_partial(out: Path, file_index: int) -> None:
    """Delete what an interrupted attempt at input file ``file_index`` left behind."""
    for split in SPLITS:
        for path in (out / split).glob(f"{file_index:06d}-*") if (out / split).is_dir() else ():
            path.unlink()


def read_manifest(path: str | Path) -> dict[str, Any]:
    root = Path(path).expanduser()
    manifest = root / MANIFEST
    if not manifest.is_file():
        if (root / "done").is_dir():
            raise DataError(f"{root} is an unfinished preparation (no {MANIFEST}); run recipes/prepare_data.py "
                            "again with the same settings to finish it")
        raise DataError(f"data.path={path} is not a prepared corpus (no {MANIFEST}); make one with "
                        "recipes/prepare_data.py")
    try:
        meta = json.loads(manifest.read_text())
        meta["splits"], meta["tokenizer"]["hash"]  # noqa: B018 - the keys every reader needs
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{manifest} is not a prepared-corpus manifest ({e}); prepare the corpus again") from None
    version, wrote = meta.get("version"), meta.get("titan_hydra", "a titan_hydra from before versions were recorded")
    if version != FORMAT_VERSION:
        newer = isinstance(version, int) and version > FORMAT_VERSION
        raise DataError(f"{manifest} has format version {version} (written by titan_hydra {wrote}); this titan_hydra "
                        f"{project_version()} reads format {FORMAT_VERSION}: "
                        + (f"read it with titan_hydra {wrote} or newer, or prepare the corpus again" if newer
                           else "prepare the corpus again"))
    return meta


class ShardedTokens:
    """One split of a prepared corpus as one flat, read-only token sequence (int32 out)."""

    def __init__(self, root: str | Path, split: str, meta: dict[str, Any] | None = None):
        self.root = Path(root).expanduser()
        meta = meta if meta is not None else read_manifest(self.root)
        self.dtype = np.dtype(meta["dtype"])
        shards = meta["splits"][split]["shards"]
        self.maps: list[np.ndarray] = []
        for shard in shards:
            path = self.root / shard["file"]
            want = int(shard["tokens"]) * self.dtype.itemsize
            have = path.stat().st_size if path.is_file() else None
            if have != want:
                raise DataError(f"shard {path} has {have if have is not None else 'no'} bytes, its manifest says "
                                f"{shard['tokens']} {self.dtype.name} tokens ({want} bytes): the corpus is damaged; "
                                "prepare it again")
            self.maps.append(np.memmap(path, dtype=self.dtype, mode="r", shape=(int(shard["tokens"]),)))
        sizes = np.array([len(m) for m in self.maps], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(sizes)])
        self.documents = int(sum(int(s["documents"]) for s in shards))

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index) -> np.ndarray:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return self[np.arange(start, stop, step)]
            return self._range(start, stop)
        idx = np.asarray(index, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"token index out of range [0, {len(self)})")
        flat = idx.reshape(-1)
        out = np.empty(flat.shape, dtype=np.int32)
        shard = np.searchsorted(self.starts, flat, side="right") - 1
        for s in np.unique(shard):
            mask = shard == s
            out[mask] = self.maps[s][flat[mask] - self.starts[s]]
        return out.reshape(idx.shape)

    def _range(self, start: int, stop: int) -> np.ndarray:
        out = np.empty(max(0, stop - start), dtype=np.int32)
        first = int(np.searchsorted(self.starts, start, side="right") - 1)
        pos, s = start, first
        while pos < stop:
            take = min(stop, int(self.starts[s + 1])) - pos
            out[pos - start: pos - start + take] = self.maps[s][pos - self.starts[s]: pos - self.starts[s] + take]
            pos, s = pos + take, s + 1
        return out
