"""Tokenize a corpus once into memory-mapped token shards; train on them at any size.

    python recipes/prepare_data.py data=json data.path=corpus/ out=prepared/corpus workers=8
    python recipes/prepare_data.py data=c4 data.hf_name=HuggingFaceFW/fineweb-edu data.hf_config=sample-10BT \
        data.tokenizer=<dir> out=prepared/fineweb-edu
    python launch.py data=prepared data.path=prepared/corpus

Configured by Hydra (``conf/prepare_data.yaml``): ``data`` is the training data group (json,
parquet or text files: ``data.path`` a file, directory or glob; ``data.text_field``,
``data.tokenizer``; ``data.val_fraction`` holds out every n-th document), ``out`` the directory,
``workers`` the processes (0: one per core), ``shard_tokens`` the shard size; ``cluster=slurm``
(any SLURM cluster config) spreads the inputs over one job's tasks instead. ``data.source=hf``
streams a hub dataset (or a local dataset directory) shard by shard instead: ``data.hf_name``,
``data.hf_config``, the ``train`` split. A killed run is resumed by running the same command
again. Errors are one line.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig

import titan_hydra.groups  # noqa: F401  (registers schemas and resolvers before composing)
from titan_hydra.data.dataset import resolve_files
from titan_hydra.data.documents import hub_shards
from titan_hydra.data.prepare import PrepareSettings, prepare, val_every_of
from titan_hydra.errors import UserError, exit_status
from titan_hydra.launch.prepare_jobs import submit_prepare
from titan_hydra.launch.submitit_jobs import JobFailed


def run(cfg: DictConfig) -> str:
    """Prepare the corpus ``cfg`` names; what to print (what was written, how to train on it)."""
    data = cfg.data
    source = str(data.source)
    if source == "hf":
        if not data.hf_name:
            raise UserError("data.source=hf needs data.hf_name (a hub dataset or a local dataset directory)")
        files = hub_shards(str(data.hf_name), data.hf_config, "train")
    elif source not in ("json", "parquet", "text"):
        raise UserError(f"data.source={source} cannot be prepared: give local files with data=json, parquet or "
                        "text, or a hub dataset with data=c4 data.hf_name=...")
    elif not data.path:
        raise UserError(f"data={data.name} needs data.path (a file, a directory or a glob)")
    else:
        files = resolve_files(str(data.path), source)
    workers = int(cfg.workers) or (os.cpu_count() or 1)
    settings = PrepareSettings(source=source, text_field=str(data.text_field), tokenizer=str(data.tokenizer),
                               val_every=val_every_of(float(data.val_fraction)), shard_tokens=int(cfg.shard_tokens),
                               out=str(Path(str(cfg.out)).expanduser().resolve()))
    started = time.perf_counter()
    if cfg.cluster.launcher == "slurm":
        manifest, tasks = submit_prepare(cfg, files, settings)
        where = f"{tasks} SLURM task(s) x {int(cfg.cluster.cpus_per_task or 1)} worker(s)"
    else:
        manifest = prepare(files, settings, workers=workers)
        where = f"{min(workers, len(files))} worker(s)"
    seconds = time.perf_counter() - started
    splits = manifest["splits"]
    total = sum(s["tokens"] for s in splits.values())
    return (f"prepared {len(files)} {'shard' if source == 'hf' else 'file'}(s) with {where} in {seconds:.1f} s: "
            + ", ".join(f"{name} {s['tokens']:,} tokens / {s['documents']:,} documents / {len(s['shards'])} shards"
                        for name, s in splits.items())
            + f" ({manifest['dtype']}; {total / max(seconds, 1e-9):,.0f} tokens/s)\n"
            + f"train on it: python launch.py data=prepared data.path={settings.out}"
            + (f" data.tokenizer={settings.tokenizer}" if settings.tokenizer != "builtin" else ""))


@hydra.main(version_base="1.3", config_path="../conf", config_name="prepare_data")
def main(cfg: DictConfig) -> None:
    try:
        status = exit_status(lambda: run(cfg))
    except JobFailed as e:  # a SLURM task died: its one-line error and log (not bad input: status 1)
        print(f"error: {e}", file=sys.stderr)
        status = 1
    if status:
        sys.exit(status)


if __name__ == "__main__":
    main()
