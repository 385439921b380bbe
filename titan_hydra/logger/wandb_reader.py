"""Read an offline W&B run (`run-*.wandb`) back without the network or wandb's server.

Offline wandb 0.31 writes no config.yaml / summary json, only this log, and ships
no reader for it, so tests and the sweep report parse it here. Format (LevelDB log):
a 7-byte header (":W&B", magic 0xBEE1 little-endian, version byte), then 32 KiB
blocks of records, each with a 7-byte header: crc(4, LE) length(2, LE) type(1),
type 1=full 2=first 3=middle 4=last; a block tail shorter than 7 bytes is padding.
Measured on wandb 0.31: the crc is plain CRC-32 (zlib, IEEE, unmasked) over the
type byte + payload, not LevelDB's masked CRC-32C. Payloads are
`wandb_internal_pb2.Record` messages.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any, Iterator

_HEADER = b":W&B"
_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def find_wandb_files(path: str | Path) -> list[Path]:
    """`.wandb` files under a run dir (or the file itself), oldest run first."""
    path = Path(path)
    if path.is_file():
        return [path]
    files = [*path.glob("wandb/*run-*/run-*.wandb"), *path.glob("*run-*/run-*.wandb"),
             *path.glob("run-*.wandb")]
    unique = {p.resolve(): p for p in files}.values()  # `latest-run` links to a real dir
    return sorted(unique, key=lambda p: (p.stat().st_mtime_ns, p.parent.name))


def iter_records(data: bytes, verify: bool = True) -> Iterator[bytes]:
    """Payloads of the log's records, reassembled across blocks."""
    if data[:4] != _HEADER:
        raise ValueError("not a W&B transaction log (missing ':W&B' header)")
    pos, pending = 7, None
    while pos + 7 <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < 7:  # block trailer padding
            pos += room
            continue
        crc, length, rtype = struct.unpack_from("<IHB", data, pos)
        if rtype == 0 and length == 0:  # zero-filled tail (preallocated / torn)
            pos += room
            continue
        payload = data[pos + 7: pos + 7 + length]
        if len(payload) < length:
            break  # torn last record after a crash: stop at the last complete one
        if verify and zlib.crc32(bytes([rtype]) + payload) != crc:
            raise ValueError(f"W&B log checksum mismatch at byte {pos}")
        pos += 7 + length
        if rtype == _FULL:
            yield payload
        elif rtype == _FIRST:
            pending = bytearray(payload)
        elif rtype in (_MIDDLE, _LAST) and pending is not None:
            pending += payload
            if rtype == _LAST:
                yield bytes(pending)
                pending = None


def _key(item: Any) -> str:
    return item.key if item.key else "/".join(item.nested_key)


def _loads(s: str) -> Any:
    try:
        return json.loads(s)
    except ValueError:
        return s


def _history_value(item: Any) -> Any:
    kind = item.WhichOneof("value")  # wandb >= 0.2x may type the value; else value_json
    if kind is None:
        return _loads(item.value_json)
    if kind == "none":
        return None
    if kind == "json":
        return _loads(item.json)
    return getattr(item, kind)


def read_offline_run(path: str | Path) -> dict[str, Any]:
    """{"config", "history" (rows with "_step"), "summary", "run", "exit_code"} of a run.

    `path` is a run dir holding `wandb/offline-run-*/run-*.wandb`, or that file.
    If the dir holds several runs, the newest (by dir name timestamp) is read.
    """
    files = find_wandb_files(path)
    if not files:
        raise FileNotFoundError(f"no run-*.wandb under {path}")
    return _read_file(files[-1])


def _read_file(file: Path) -> dict[str, Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    out: dict[str, Any] = {"config": {}, "history": [], "summary": {}, "run": {},
                           "exit_code": None, "file": str(file)}

    def apply_config(update, remove=()):
        for item in update:
            if not _key(item).startswith("_wandb"):
                out["config"][_key(item)] = _loads(item.value_json)  # stored unwrapped
        for item in remove:
            out["config"].pop(_key(item), None)

    for payload in iter_records(file.read_bytes()):
        rec = pb.Record()
        rec.ParseFromString(payload)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            r = rec.run
            out["run"] = {"id": r.run_id, "project": r.project, "entity": r.entity,
                          "group": r.run_group, "name": r.display_name, "job_type": r.job_type,
                          "tags": list(r.tags), "notes": r.notes}
            apply_config(r.config.update, r.config.remove)
        elif kind == "config":
            apply_config(rec.config.update, rec.config.remove)
        elif kind == "history":
            row = {_key(i): _history_value(i) for i in rec.history.item}
            if "_step" not in row and rec.history.HasField("step"):
                row["_step"] = rec.history.step.num
            out["history"].append(row)
        elif kind == "summary":
            for item in rec.summary.update:
                out["summary"][_key(item)] = _loads(item.value_json)
            for item in rec.summary.remove:
                out["summary"].pop(_key(item), None)
        elif kind == "exit":
            out["exit_code"] = rec.exit.exit_code
    return out
