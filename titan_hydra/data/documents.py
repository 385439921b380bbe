"""Documents of one local file, streamed: what corpus preparation reads (``data/prepare.py``).

The packed path loads a whole split through HF ``datasets``; preparing a corpus of any size
must instead hold one document (or one parquet row group) at a time, so each format is read
here with the standard library or pyarrow:

* json: JSON lines (``.jsonl``, ``.json``, optionally ``.gz``), one object per line with the
  text under ``text_field``; a file whose first character is ``[`` is one array (read whole);
  the packed path checks its files with the same reader (``dataset.validate_json_file``);
* parquet: the ``text_field`` column, batch by batch;
* text: paragraphs separated by blank lines (as the packed path's ``sample_by="paragraph"``);
* hf: one shard (``HubShard``) of a dataset streamed by HF ``datasets`` (a hub name such as
  ``HuggingFaceFW/fineweb-edu`` or a local dataset directory): the dataset's own data files are
  its shards, so each is a unit of work as a local file is, and nothing is downloaded whole.

Empty documents are skipped; a bad record fails with one line naming the file and the line.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import asdict, dataclass
from typing import Any, Iterator, Union

from titan_hydra.errors import DataError, first_line

PARQUET_BATCH_ROWS = 1024


@dataclass(frozen=True)
class HubShard:
    """Shard ``index`` of ``count`` of a streamed HF dataset split: preparation's unit of work
    for ``data.source=hf`` (a local file is the unit for the other sources)."""

    name: str
    config: str | None
    split: str
    index: int
    count: int

    def key(self) -> dict[str, Any]:
        """What identifies this input in the resume records and the settings file."""
        return {"hf": self.name, **{k: v for k, v in asdict(self).items() if k != "name"}}

    def __str__(self) -> str:
        return f"{self.name} ({self.config or 'default'}) {self.split} shard {self.index + 1}/{self.count}"


Input = Union[str, HubShard]  # a local file's path, or a hub shard


def _stream(name: str, config: str | None, split: str):
    import datasets  # heavy and only needed for hub sources

    try:
        return datasets.load_dataset(name, config, split=split, streaming=True)
    except Exception as e:  # datasets raises many types (missing dataset, config, split, network)
        raise DataError(f"could not stream dataset {name} ({config or 'default'}) split {split}: "
                        f"{first_line(e)}") from None


def hub_shards(name: str, config: str | None = None, split: str = "train") -> list[HubShard]:
    """The shards of a streamed dataset split (its data files), in the dataset's order."""
    count = int(_stream(name, config, split).n_shards)
    return [HubShard(name, config, split, i, count) for i in range(count)]


def _hub_documents(shard: HubShard, field: str) -> Iterator[str]:
    ds = _stream(shard.name, shard.config, shard.split).shard(num_shards=shard.count, index=shard.index)
    for i, rec in enumerate(ds):
        yield check_record(rec, str(shard), f"record {i + 1}", field)


def open_text(path: str):
    return gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path, encoding="utf-8")


def check_record(rec, path: str, where: str, text_field: str) -> str:
    """The text of one JSON record, or a one-line DataError naming the file and the record."""
    if not isinstance(rec, dict):
        raise DataError(f"bad record in {path} {where}: expected a JSON object, got {type(rec).__name__}")
    if text_field not in rec:
        raise DataError(
            f"bad record in {path} {where}: missing text field {text_field!r} (set data.text_field=...)"
        )
    value = rec[text_field]
    if value is not None and not isinstance(value, str):
        raise DataError(
            f"bad record in {path} {where}: text field {text_field!r} is {type(value).__name__}, expected a string"
        )
    return value or ""


def json_texts(path: str, text_field: str) -> Iterator[str]:
    """The texts of a JSON-lines file (one record per line, streamed) or of a file holding one
    JSON array (read whole), checking every record."""
    with open_text(path) as f:
        head = f.read(4096).lstrip()
    if head.startswith("["):  # one JSON array of records
        with open_text(path) as f:
            try:
                records = json.load(f)
            except json.JSONDecodeError as e:
                raise DataError(f"bad record in {path} line {e.lineno}: invalid JSON ({e.msg})") from None
        for i, rec in enumerate(records):
            yield check_record(rec, path, f"record {i + 1}", text_field)
        return
    with open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"bad record in {path} line {lineno}: invalid JSON ({e.msg})") from None
            yield check_record(rec, path, f"line {lineno}", text_field)


def _parquet_documents(path: str, field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        reader = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a file that is not parquet
        raise DataError(f"{path} is not a readable parquet file ({first_line(e)})") from None
    if field not in reader.schema_arrow.names:
        raise DataError(f"{path} has no column {field!r}; columns are {reader.schema_arrow.names} "
                        "(set data.text_field=...)")
    for batch in reader.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[field]):
        for text in batch.column(0).to_pylist():
            yield text or ""


def _text_documents(path: str) -> Iterator[str]:
    para: list[str] = []
    with open_text(path) as f:
        for line in f:
            if line.strip():
                para.append(line)
            elif para:
                yield "".join(para).rstrip("\n")
                para = []
    if para:
        yield "".join(para).rstrip("\n")


def iter_documents(path: Input, source: str, text_field: str = "text") -> Iterator[str]:
    """The non-empty documents of one file (or hub shard), in order."""
    if isinstance(path, HubShard):
        docs = _hub_documents(path, text_field)
    elif source == "json":
        docs = json_texts(path, text_field)
    elif source == "parquet":
        docs = _parquet_documents(path, text_field)
    elif source == "text":
        docs = _text_documents(path)
    else:
        raise DataError(f"data.source={source} cannot be prepared; use json, parquet, text or hf")
    try:
        for doc in docs:
            if doc.strip():
                yield doc
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text ({first_line(e)})") from None
    except (OSError, EOFError) as e:
        raise DataError(f"{path} cannot be read ({first_line(e)})") from None
