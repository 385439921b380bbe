"""Tokenize a corpus once into token shards (``recipes/prepare_data.py`` is the command).

Why not the packed path's cache: that one tokenizes a whole split into one in-memory array on
rank 0 before the first step (about 13.5 bytes of RAM per token), so its size is bounded by one
machine's memory and its time by one process. Here:

* memory is bounded whatever the corpus size: documents are streamed from each file
  (``documents.py``) and at most ``shard_tokens`` tokens per split are buffered before they go to
  disk (uint16 where the vocab fits);
* the work is split by input file (for a streamed HF dataset: by its shards, i.e. its data
  files) over worker processes; shard names carry the input's index, so the result is identical
  whatever the number of workers;
* a kill loses at most the files in flight: each finished file leaves a ``done`` record, a rerun
  with the same settings skips those files and redoes the others (their partial shards are
  deleted first), and ``manifest.json`` is written last.

Validation documents: every ``val_every``-th document of each file (the data config's
``val_fraction``, e.g. 0.05 -> every 20th), decided while streaming, so no document count is
needed up front.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from titan_hydra.data.documents import HubShard, Input, iter_documents
from titan_hydra.data.loader import iter_chunks
from titan_hydra.data.shards import (
    FORMAT_VERSION, MANIFEST, SPLITS, ShardBuffer, remove_partial, token_dtype, write_json_atomic,
)
from titan_hydra.data.tokenizer import Tokenizer
from titan_hydra.errors import DataError
from titan_hydra.version import project_version

ENCODE_CHUNK = 256  # documents per encode_batch call
SETTINGS = "settings.json"


@dataclass(frozen=True)
class PrepareSettings:
    source: str
    text_field: str
    tokenizer: str
    val_every: int  # every n-th document of a file goes to val (0: none)
    shard_tokens: int
    out: str


def val_every_of(val_fraction: float) -> int:
    """0 for no validation split, else n such that every n-th document is held out."""
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"data.val_fraction={val_fraction} must be in [0, 1)")
    return 0 if val_fraction == 0 else max(2, round(1.0 / val_fraction))


def input_key(path: Input) -> dict[str, Any]:
    """What identifies an input: a file's path, size and mtime (an edited file is redone), or a hub shard."""
    if isinstance(path, HubShard):
        return path.key()
    st = os.stat(path)
    return {"path": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


_TOKENIZERS: dict[str, Tokenizer] = {}


def _tokenizer(name: str) -> Tokenizer:
    """One tokenizer per worker process (loading it per file would dominate small files)."""
    if name not in _TOKENIZERS:
        _TOKENIZERS[name] = Tokenizer(name)
    return _TOKENIZERS[name]


def prepare_file(task: tuple[int, Input, PrepareSettings]) -> dict[str, Any]:
    """Tokenize one input (a file or a hub shard) into its shards; returns (and records) what it wrote."""
    index, path, settings = task
    out = Path(settings.out)
    done = out / "done" / f"{index:06d}.json"
    key = input_key(path)
    if done.is_file():
        record = json.loads(done.read_text())
        if record.get("input") == key:
            return record  # finished by an earlier attempt
    remove_partial(out, index)
    tok = _tokenizer(settings.tokenizer)
    dtype = token_dtype(tok.vocab_size)
    buffers = {s: ShardBuffer(out, s, index, dtype, settings.shard_tokens) for s in SPLITS}
    n = 0
    for chunk in iter_chunks(iter_documents(path, settings.source, settings.text_field), ENCODE_CHUNK):
        for ids in tok.encode_batch(chunk):
            n += 1
            split = "val" if settings.val_every and n % settings.val_every == 0 else "train"
            buffers[split].add([tok.bos_id, *ids, tok.eos_id])
    record = {"input": key, "documents": n, "splits": {s: buffers[s].commit() for s in SPLITS}}
    write_json_atomic(done, record)
    return record


def _check_settings(out: Path, payload: dict[str, Any]) -> None:
    """An output directory holds one corpus: a rerun must ask for the same one (it resumes it)."""
    path = out / SETTINGS
    if path.is_file():
        old = json.loads(path.read_text())
        if old != payload:
            changed = sorted(k for k in set(old) | set(payload) if old.get(k) != payload.get(k))
            raise DataError(f"{out} holds a corpus prepared with other settings ({', '.join(changed)} differ); "
                            "choose another out= directory or delete this one")
    else:
        out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, payload)


def begin(files: list[Input], settings: PrepareSettings) -> Path:
    """Check the inputs and settings (a bad tokenizer or another corpus in ``out`` fails here, before
    any worker or job starts) and record the settings; returns the output directory."""
    if not files:
        raise DataError("no input files to prepare")
    if settings.shard_tokens < 1:
        raise DataError(f"shard_tokens={settings.shard_tokens} must be >= 1")
    tok = _tokenizer(settings.tokenizer)
    out = Path(settings.out).expanduser()
    payload = {"version": FORMAT_VERSION, "settings": {k: v for k, v in asdict(settings).items() if k != "out"},
               "tokenizer_hash": tok.content_hash, "inputs": [input_key(f) for f in files]}
    _check_settings(out, payload)
    (out / "done").mkdir(parents=True, exist_ok=True)
    return out


def prepare_part(files: list[Input], settings: PrepareSettings, workers: int = 1,
                 part: int = 0, parts: int = 1) -> int:
    """Prepare inputs ``part``, ``part + parts``, ... of ``files`` with ``workers`` processes (one
    SLURM task's share when ``parts`` > 1); returns how many inputs it covered. Shard names carry
    the input's index in ``files``, so how the inputs are split changes nothing on disk."""
    tasks = [(i, f, settings) for i, f in enumerate(files) if i % parts == part]
    workers = max(1, min(int(workers), len(tasks)))
    if workers == 1:
        for t in tasks:
            prepare_file(t)
    else:
        # Spawned workers: a clean interpreter each (no inherited tokenizer thread pools), one
        # Rust thread each so that the workers, not the tokenizer's threads, share the cores.
        os.environ.setdefault("RAYON_NUM_THREADS", "1")
        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            pool.map(prepare_file, tasks, chunksize=1)
    return len(tasks)


def finish(files: list[Input], settings: PrepareSettings) -> dict[str, Any]:
    """Write ``manifest.json`` from every input's ``done`` record (last: a corpus without one is
    unfinished); one line naming the first input that is not done."""
    out = Path(settings.out).expanduser()
    tok = _tokenizer(settings.tokenizer)
    records = []
    for i, f in enumerate(files):
        done = out / "done" / f"{i:06d}.json"
        record = json.loads(done.read_text()) if done.is_file() else None
        if record is None or record.get("input") != input_key(f):
            raise DataError(f"input {i} ({f}) of {out} is not prepared; run the same command again to finish it")
        records.append(record)
    splits = {}
    for split in SPLITS:
        shards = [shard for r in records for shard in r["splits"][split]]
        splits[split] = {"tokens": sum(s["tokens"] for s in shards), "documents": sum(s["documents"] for s in shards),
                         "shards": shards}
    manifest = {
        "version": FORMAT_VERSION,
        "titan_hydra": project_version(),  # the code that wrote it, named when a later one refuses it
        "dtype": token_dtype(tok.vocab_size).name,
        "tokenizer": {"name": settings.tokenizer, "hash": tok.content_hash, "vocab_size": tok.vocab_size,
                      "bos_id": tok.bos_id, "eos_id": tok.eos_id},
        "source": {"source": settings.source, "text_field": settings.text_field, "files": len(files),
                   "val_every": settings.val_every},
        "splits": splits,
    }
    write_json_atomic(out / MANIFEST, manifest)
    return manifest


def prepare(files: list[Input], settings: PrepareSettings, workers: int = 1) -> dict[str, Any]:
    """Prepare ``files`` (in this order) into ``settings.out`` on this machine; returns the manifest."""
    begin(files, settings)
    prepare_part(files, settings, workers)
    return finish(files, settings)
