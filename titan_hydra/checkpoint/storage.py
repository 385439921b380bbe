"""On-disk layout of checkpoints, and reading them without trusting them.

A run's checkpoints live in ``<run_dir>/<checkpoint.folder>/step-<N>/``: DCP's files plus a
completion marker (``COMPLETE.json``) that rank 0 writes last, by atomic rename, once every
rank's data and DCP's ``.metadata`` are on disk. A directory without the marker is a save
that was interrupted (killed, crashed): it is never loaded.

DCP stores its ``.metadata`` as a pickle and reads non-tensor entries with
``torch.load(weights_only=False)``. A checkpoint may come from anywhere (``initial_load_path``),
so this module (1) reads ``.metadata`` with an unpickler that only admits DCP's own metadata
classes and a few torch value types, and (2) this package stores no non-tensor entries at all
(small state is JSON inside uint8 tensors, see ``json_tensor``), so DCP's tensor path, which
uses ``weights_only=True``, is the only one ever taken. Every file referenced by the metadata
is checked for existence and length before anything is loaded, so a truncated checkpoint fails
with one message and before any parameter changed.

The marker also records every file's size and CRC-32 (``files``), taken after all ranks finished
writing: a shard that changed afterwards (bit rot, a partial copy, a file from another save)
is refused on load, naming the file. CRC-32 because zlib computes it at several GB/s, so a
100M-parameter checkpoint gains a fraction of a second; it detects corruption, not tampering
(the restricted unpickler and tensor-only entries are what make a foreign checkpoint safe).
Markers written before ``files`` existed load as before (lengths checked, no checksums).
"""

from __future__ import annotations

import collections
import io
import json
import os
import pathlib
import pickle
import re
import shutil
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_fs
import torch.distributed.checkpoint.metadata as dcp_md
from torch import serialization
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from titan_hydra.errors import first_line
from titan_hydra.quiet import DCP_SINGLE_PROCESS, ignoring
from titan_hydra.errors import CheckpointError  # re-exported: titan_hydra.checkpoint.storage.CheckpointError

MARKER = "COMPLETE.json"
STEP_RE = re.compile(r"^step-(\d+)$")
# DCP reports a rank's failed read or write as CheckpointException, a BaseException (not an Exception).
DCP_ERRORS = (Exception, CheckpointException)


# --------------------------------------------------------------------------- step dirs


def step_dir(folder: str | Path, step: int) -> Path:
    return Path(folder) / f"step-{step}"


@dataclass
class StepDir:
    step: int
    path: Path
    complete: bool


def list_steps(folder: str | Path) -> list[StepDir]:
    """All ``step-N`` directories under ``folder``, oldest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    out = []
    for child in folder.iterdir():
        m = STEP_RE.match(child.name)
        if m and child.is_dir():
            out.append(StepDir(int(m.group(1)), child, (child / MARKER).is_file()))
    return sorted(out, key=lambda s: s.step)


def latest_complete(folder: str | Path) -> tuple[StepDir | None, list[StepDir]]:
    """(newest complete checkpoint, incomplete ones newer than it)."""
    steps = list_steps(folder)
    complete = [s for s in steps if s.complete]
    best = complete[-1] if complete else None
    skipped = [s for s in steps if not s.complete and (best is None or s.step > best.step)]
    return best, skipped


CRC_BLOCK = 16 << 20


def file_crc32(file: Path) -> str:
    crc = 0
    with open(file, "rb") as f:
        while block := f.read(CRC_BLOCK):
            crc = zlib.crc32(block, crc)  # releases the GIL: files are summed in parallel threads
    return f"{crc:08x}"


def record_files(path: Path) -> dict[str, dict[str, Any]]:
    """Size and CRC-32 of every file of a finished save (the marker's ``files``)."""
    files = sorted(f for f in Path(path).iterdir() if f.is_file() and not f.name.startswith(MARKER))
    with ThreadPoolExecutor(max(1, min(8, len(files)))) as pool:
        crcs = list(pool.map(file_crc32, files))
    return {f.name: {"size": f.stat().st_size, "crc32": crc} for f, crc in zip(files, crcs)}


def write_marker(path: Path, info: dict[str, Any]) -> None:
    """Record the files' sizes and checksums, then write the marker atomically (tmp file + rename).

    A failed write (disk full) leaves no marker, so the save stays incomplete.
    """
    info = {**info, "files": record_files(path)}
    tmp = path / (MARKER + ".tmp")
    try:
        tmp.write_text(json.dumps(info, indent=1, sort_keys=True))
        os.replace(tmp, path / MARKER)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def verify_files(path: str | Path, marker: dict[str, Any] | None, names: set[str] | None = None) -> None:
    """Check the files the marker recorded (``names``: only these, plus ``.metadata``) against their
    recorded size and CRC-32. A marker without ``files`` (older checkpoints) is not checked."""
    recorded = (marker or {}).get("files")
    if not isinstance(recorded, dict):
        return
    path = Path(path)
    wanted = sorted(recorded if names is None else (set(names) | {".metadata"}) & set(recorded))
    for name in wanted:
        f, want = path / name, recorded[name]
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path}: file {name} is missing (the completion marker lists it)")
        size = f.stat().st_size
        if size != want.get("size"):
            raise CheckpointError(
                f"checkpoint {path}: file {name} has {size} bytes, the completion marker recorded {want.get('size')} "
                "(truncated or replaced after the save); restore it or load another step"
            )
    with ThreadPoolExecutor(max(1, min(8, len(wanted)))) as pool:
        crcs = dict(zip(wanted, pool.map(lambda n: file_crc32(path / n), wanted)))
    for name in wanted:
        if crcs[name] != recorded[name].get("crc32"):
            raise CheckpointError(
                f"checkpoint {path}: file {name} is corrupted (CRC-32 {crcs[name]}, the completion marker "
                f"recorded {recorded[name].get('crc32')}); restore it or load another step"
            )


def read_marker(path: Path) -> dict[str, Any] | None:
    marker = Path(path) / MARKER
    if not marker.is_file():
        return None
    try:
        return json.loads(marker.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: completion marker {MARKER} is unreadable ({first_line(e)})") from None


def remove_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------- JSON state


def json_tensor(obj: Any) -> torch.Tensor:
    """Small JSON-serializable state as a uint8 tensor (so DCP never pickles it)."""
    data = json.dumps(obj, sort_keys=True).encode("utf-8")
    return torch.tensor(list(data), dtype=torch.uint8)


def tensor_json(t: torch.Tensor) -> Any:
    return json.loads(bytes(t.cpu().tolist()).decode("utf-8"))


# --------------------------------------------------------------------------- safe metadata


def _allowed_globals() -> dict[tuple[str, str], Any]:
    allowed: dict[tuple[str, str], Any] = {}
    for mod in (dcp_md, dcp_fs):
        for name in dir(mod):
            obj = getattr(mod, name)
            if isinstance(obj, type) and obj.__module__ == mod.__name__:
                allowed[(mod.__name__, name)] = obj
    allowed[("torch", "Size")] = torch.Size
    for name in dir(torch):
        obj = getattr(torch, name)
        if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[("torch", name)] = obj
    allowed[("torch.serialization", "_get_layout")] = serialization._get_layout  # str -> torch.layout
    allowed[("pathlib", "PosixPath")] = pathlib.PurePosixPath
    allowed[("pathlib", "WindowsPath")] = pathlib.PureWindowsPath
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    allowed[("builtins", "set")] = set
    allowed[("builtins", "frozenset")] = frozenset
    allowed[("builtins", "getattr")] = None  # placeholder: only torch.<dtype> lookups, see below
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata dataclasses and torch value types; anything else is refused."""

    _allowed: dict[tuple[str, str], Any] | None = None

    def find_class(self, module: str, name: str) -> Any:
        if _MetadataUnpickler._allowed is None:
            _MetadataUnpickler._allowed = _allowed_globals()
        if (module, name) == ("builtins", "getattr"):
            return _safe_getattr
        obj = _MetadataUnpickler._allowed.get((module, name))
        if obj is None:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        return obj


def _safe_getattr(obj: Any, name: str) -> Any:
    if obj is torch and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
        return getattr(torch, name)
    raise pickle.UnpicklingError(f"refusing getattr({obj!r}, {name!r})")


def read_metadata(path: str | Path):
    """DCP ``Metadata`` of the checkpoint at ``path``, read with the restricted unpickler."""
    path = Path(path)
    meta_file = path / ".metadata"
    if not meta_file.is_file():
        raise CheckpointError(f"checkpoint {path}: no DCP .metadata file (not a DCP checkpoint directory)")
    try:
        metadata = _MetadataUnpickler(io.BytesIO(meta_file.read_bytes())).load()
    except Exception as e:  # truncated, foreign or hostile file
        raise CheckpointError(f"checkpoint {path}: .metadata is unreadable or not DCP metadata ({first_line(e)})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"checkpoint {path}: .metadata holds {type(metadata).__name__}, not DCP Metadata")
    return metadata


def safe_reader(path: str | Path):
    """A DCP FileSystemReader whose metadata comes from ``read_metadata``."""
    class _SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            md = read_metadata(self.path)
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            if md.planner_data is None:
                md.planner_data = {}
            return md

    return _SafeReader(str(path))


def check_files(path: str | Path, metadata, keys: set[str] | None = None) -> set[str]:
    """Every data file the wanted entries need exists and is long enough; returns their names."""
    path = Path(path)
    need: dict[str, int] = {}
    for index, info in (metadata.storage_data or {}).items():
        if keys is not None and index.fqn not in keys:
            continue
        rel = info.relative_path
        need[rel] = max(need.get(rel, 0), int(info.offset) + int(info.length))
    for rel, length in sorted(need.items()):
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path}: data file {rel} is missing")
        size = f.stat().st_size
        if size < length:
            raise CheckpointError(
                f"checkpoint {path}: data file {rel} is truncated ({size} bytes, needs {length})"
            )
    return set(need)


def tensor_entries(metadata) -> dict[str, Any]:
    """Tensor entries of a checkpoint: key -> TensorStorageMetadata (bytes entries left out)."""
    return {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def load_plain(path: str | Path, keys: list[str], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Read whole tensors ``keys`` of a DCP checkpoint in this process (no process group)."""
    metadata = read_metadata(path)
    entries = tensor_entries(metadata)
    missing = [k for k in keys if k not in entries]
    if missing:
        raise CheckpointError(f"checkpoint {path}: missing entries {missing[:5]}")
    verify_files(path, read_marker(path), check_files(path, metadata, set(keys)))
    out = {k: torch.empty(tuple(entries[k].size), dtype=entries[k].properties.dtype) for k in keys}
    with ignoring(DCP_SINGLE_PROCESS):  # no_dist=True: one process is the intent
        dcp.load(out, storage_reader=safe_reader(path), no_dist=True)
    if dtype is not None:
        out = {k: v.to(dtype) if v.is_floating_point() else v for k, v in out.items()}
    return out


def save_plain(path: str | Path, state: dict[str, torch.Tensor], marker: dict[str, Any]) -> None:
    """Write a flat tensor dict as a DCP checkpoint from one process, then its marker."""
    path = Path(path)
    if path.exists():
        remove_dir(path)
    path.mkdir(parents=True)
    with ignoring(DCP_SINGLE_PROCESS):
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    write_marker(path, marker)
