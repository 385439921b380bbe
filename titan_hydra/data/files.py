"""Local data files: finding them (``data.path``: a file, a directory or a glob) and refusing a bad
one before HF ``datasets`` does, because its errors name neither the file nor the line."""

from __future__ import annotations

import codecs
import glob as _glob
import gzip
import os
import zlib
from pathlib import Path

from titan_hydra.data.documents import json_texts
from titan_hydra.errors import DataError, first_line

EXTENSIONS = {
    "json": (".jsonl", ".json", ".jsonl.gz", ".json.gz"),
    "parquet": (".parquet",),
    "text": (".txt", ".text", ".md"),
}
TEXT_PROBE_BYTES = 1 << 16  # how much of a streamed file check_text_file reads


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


def _check_block(path: str, block: bytes, offset: int, decoder) -> None:
    nul = block.find(b"\0")
    if nul >= 0:
        raise DataError(f"data file {path} is binary (a NUL byte at offset {offset + nul}); "
                        "json/text sources need UTF-8 text")
    try:
        decoder.decode(block)
    except UnicodeDecodeError as e:
        raise DataError(f"data file {path} is not UTF-8 text (invalid byte at offset "
                        f"{offset + e.start}); convert it to UTF-8") from None


def check_text_file(path: str, whole: bool = True) -> None:
    """Refuse an empty, binary or non-UTF-8 json/text data file, naming it and the first bad byte.

    HF ``datasets`` reports such a file as "An error occurred while generating the dataset" (or
    not at all: an empty file is zero documents and the run fails later, on an empty split).
    ``whole=False`` (streamed data, possibly huge) reads only the first TEXT_PROBE_BYTES.
    """
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
                _check_block(path, block, offset, decoder)
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


def check_files(files: list[str], source: str, text_field: str, streaming: bool) -> None:
    """Every check that applies to these files before HF ``datasets`` reads them."""
    for f in files:
        if source in ("json", "text"):
            check_text_file(f, whole=not streaming)
        elif os.path.getsize(f) == 0:
            raise DataError(f"data file {f} is empty (0 bytes); remove it or point data.path elsewhere")
        if source == "json" and not streaming:
            validate_json_file(f, text_field)


def file_fingerprint(files: list[str]) -> list:
    """What identifies the files' contents for the token cache: path, size and mtime of each."""
    return [[os.path.abspath(f), os.path.getsize(f), os.stat(f).st_mtime_ns] for f in files]
