"""The token cache: a source's packed splits stored as ``.npy``, keyed by everything that
determines them, so every rank after the first and every later run skips tokenization.

Files are written then renamed, so concurrent ranks never read a half-written one.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from titan_hydra.data.packing import SPLITS, TokenSplits, new_stats
from titan_hydra.errors import DataError, first_line

CACHE_VERSION = 1


def default_cache_dir() -> Path:
    return Path(os.environ.get("TITAN_HYDRA_CACHE", Path.home() / ".cache" / "titan_hydra"))


def _atomic_save(path: Path, array: np.ndarray) -> None:
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


class TokenCache:
    """The cached splits of one source whose key material is ``material`` (any JSON value)."""

    def __init__(self, cache_dir: Path, source: str, material: dict[str, Any]):
        self.cache_dir, self.material = cache_dir, material
        self.key = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:24]
        base = cache_dir / f"tokens-{source}-{self.key}"
        self.meta_path = Path(f"{base}.json")
        self.paths = {s: Path(f"{base}-{s}.npy") for s in SPLITS}

    def load(self) -> TokenSplits | None:
        """The cached splits (memory-mapped), or None when absent or unreadable (rebuild them)."""
        if not (self.meta_path.is_file() and all(p.is_file() for p in self.paths.values())):
            return None
        try:
            meta = json.loads(self.meta_path.read_text())
            tokens = {s: np.load(p, mmap_mode="r") for s, p in self.paths.items()}
            stats = new_stats()
            stats.update(meta["stats"])
        except (ValueError, KeyError, OSError):
            return None
        return TokenSplits(tokens, stats, self.key, cache_hit=True)

    def check_writable(self) -> None:
        """Before tokenizing: the result must be storable."""
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=self.cache_dir):
                pass
        except OSError as e:
            raise DataError(
                f"token cache {self.cache_dir} is not writable ({first_line(e)}); set data.cache_dir (or "
                "TITAN_HYDRA_CACHE) to a writable directory"
            ) from None

    def save(self, splits: TokenSplits) -> TokenSplits:
        for split in SPLITS:
            _atomic_save(self.paths[split], np.asarray(splits.tokens[split]))
        _atomic_write_text(self.meta_path, json.dumps({"stats": splits.stats, "key": self.material}, indent=1))
        splits.cache_key = self.key
        return splits
