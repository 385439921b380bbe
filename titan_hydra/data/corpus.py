"""The built-in corpus: the Python standard library's own ``.py`` sources.

Why this corpus: it is present on every machine that runs the project (no download,
no network), it is real text of a few MB, and it is deterministic for a given Python
build. Tests, the debug recipe and the shipped tokenizer all train on it.

The validation split is a fixed subset of *files* chosen by a stable content-free hash
of the relative path, so train and validation never share a document and the split does
not depend on file order, the machine, or ``PYTHONHASHSEED``.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from functools import lru_cache
from pathlib import Path

EXCLUDED_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "__pycache__"})
VAL_MODULUS = 20  # one file in twenty (by path hash) is held out for validation
SPLITS = ("train", "val")


def stdlib_root() -> Path:
    """Directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_val_file(rel_path: str) -> bool:
    """True when ``rel_path`` belongs to the held-out split (stable across runs and hosts)."""
    digest = hashlib.sha1(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % VAL_MODULUS == 0


@lru_cache(maxsize=None)
def builtin_files(split: str | None = None) -> tuple[Path, ...]:
    """Sorted source files of the corpus; ``split`` = "train", "val" or None (all)."""
    if split not in (None, *SPLITS):
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    root = stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]  # prune, don't descend
        for name in filenames:
            if name.endswith(".py"):
                p = Path(dirpath) / name
                out.append((p.relative_to(root).as_posix(), p))
    out.sort(key=lambda item: item[0])
    if split is not None:
        want_val = split == "val"
        out = [item for item in out if is_val_file(item[0]) == want_val]
    return tuple(p for _, p in out)


def builtin_documents(split: str | None = None, max_documents: int | None = None) -> list[str]:
    """File texts of the built-in corpus, in sorted path order.

    Undecodable bytes are replaced rather than skipped so the document set never
    depends on locale settings.
    """
    files = builtin_files(split)
    if max_documents is not None:
        files = files[:max_documents]
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def builtin_fingerprint(split: str | None = None) -> str:
    """Hash of the file list with sizes and mtimes: changes when the interpreter changes."""
    h = hashlib.sha256()
    root = stdlib_root()
    for p in builtin_files(split):
        st = p.stat()
        h.update(f"{p.relative_to(root).as_posix()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()
