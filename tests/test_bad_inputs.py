"""The reliability catalogue: bad inputs a newcomer meets, each refused with one line.

One table (``CATALOGUE``), one row per bad input: an id, how to make it, the error type and a
regex for the message. Rows run in this process through the entry points a run goes through
before it trains (``validate``, then the dataset and loaders of ``pretrain.build_data``, then
``CheckpointManager.load`` / ``restore``), so the whole table takes seconds. Every row asserts
the type, the message and that the message is one line. ``LAUNCHED`` repeats a few rows
through ``launch.py`` in subprocesses (two at a time) to show the end-to-end form: exit code 2,
one ``error:`` line last on stderr, no traceback.

Kinds of input: config (cross-field rules and value ranges), data (files, tokenizer, token
cache), checkpoint (corrupted, truncated, foreign, another model, another data position) and
environment (unwritable directories, a bad ``WORLD_SIZE``, no GPU).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

from titan_hydra.spec import spec_of
from helpers import REPO, TINY, compose_cfg
from titan_hydra.checkpoint import CheckpointError, CheckpointManager
from titan_hydra.errors import ConfigError, DataError, UserError
from titan_hydra.validate import check_writable_dir, validate

BUILTIN_TOKENIZER = REPO / "titan_hydra" / "assets" / "builtin_tokenizer.json"


@dataclass
class Row:
    id: str
    act: Callable[[Path], None]  # makes the bad input under a fresh directory and runs the entry point
    error: type
    pattern: str


# ----------------------------------------------------------------------------- entry points


def refuse(overrides: list[str]) -> None:
    """What a run does before the model exists: validate the config, build the data and loaders."""
    from titan_hydra.train.services import build_data

    cfg = compose_cfg(TINY + overrides)
    validate(cfg)
    build_data(spec_of(cfg))


def config(id: str, overrides: list[str], pattern: str, error: type = ConfigError) -> Row:
    return Row(id, lambda tmp: refuse(overrides), error, pattern)


def files(id: str, make: Callable[[Path], list[str]], pattern: str, error: type = DataError) -> Row:
    """``make(tmp)`` writes the bad files and returns the overrides that point at them."""
    return Row(id, lambda tmp: refuse(make(tmp)), error, pattern)


def write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return path


def jsonl(records: list) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def json_data(tmp: Path, content: str | bytes, name: str = "d.jsonl") -> list[str]:
    return ["data=json", f"data.path={write(tmp / name, content)}"]


def text_data(tmp: Path, content: str | bytes, name: str = "d.txt") -> list[str]:
    return ["data=text", f"data.path={write(tmp / name, content)}"]


DOCS = jsonl([{"text": f"document {i} " + "words " * 40} for i in range(40)])


def parquet(tmp: Path, column: str) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp / "d.parquet"
    pq.write_table(pa.table({column: ["some text " * 30] * 20}), path)
    return ["data=parquet", f"data.path={path}"]


def tokenizer_dir(tmp: Path, config: str) -> list[str]:
    shutil.copy(BUILTIN_TOKENIZER, tmp / "tokenizer.json")
    write(tmp / "tokenizer_config.json", config)
    return [f"data.tokenizer={tmp}"]


def blocked(tmp: Path) -> Path:
    """A path below a regular file: no one (root included) can create a directory there."""
    return write(tmp / "a_file", "x") / "sub"


# ----------------------------------------------------------------------------- checkpoints

SEQ = 16


def manager(run_dir: Path, overrides: list[str] = (), loader=None, world_size: int = 1, **settings) -> CheckpointManager:
    """A CheckpointManager over the TINY model of ``overrides`` (one process, a real optimizer state)."""
    from titan_hydra.models.registry import args_of, build_model
    from titan_hydra.parallel.parallelism import ParallelDims
    from titan_hydra.schedules import WarmupDecay
    from titan_hydra.train.trainer import TrainState

    cfg = compose_cfg(TINY + list(overrides))
    torch.manual_seed(0)
    family, model = build_model(cfg.model)
    _, args = args_of(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # an optimizer state to save
    return CheckpointManager(
        run_dir=run_dir, model_parts=[model], optimizer=opt, lr_scheduler=WarmupDecay()(opt, 10),
        train_loader=loader if loader is not None else packed_loader(), train_state=TrainState(),
        dims=ParallelDims(world_size=world_size), family=family, model_args=args, flavor=str(cfg.model.flavor),
        world_size=world_size, **{"enable": True, "interval": 1, **settings},
    )


def packed_loader(seq_len: int = SEQ, tokens: int = 4000):
    from titan_hydra.data.loader import BatchLoader

    return BatchLoader(np.arange(tokens, dtype=np.int32) % 1000, seq_len, 2)


def streaming_loader(tmp: Path):
    from titan_hydra.data.dataset import TokenDataset

    path = write(tmp / "stream.jsonl", DOCS)
    return TokenDataset("json", path=str(path), seq_len=SEQ, streaming=True, cache_dir=str(tmp / "cache")).loader("train", 2)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A complete full-state checkpoint (model, optimizer, packed loader position) of the TINY Llama 3."""
    run_dir = tmp_path_factory.mktemp("saved")
    return manager(run_dir).save(3, wait=True)


SAVED: dict[str, Path] = {}  # filled by the autouse fixture below: rows are built at import time


@pytest.fixture(autouse=True)
def _saved_checkpoint(saved):
    SAVED["path"] = saved


def copy_saved(tmp: Path) -> Path:
    """A private copy of the saved checkpoint, as the newest step of ``tmp/run/checkpoint``."""
    dst = tmp / "run" / "checkpoint" / SAVED["path"].name
    shutil.copytree(SAVED["path"], dst)
    return dst


def shard(path: Path) -> Path:
    return sorted(path.glob("*.distcp"))[0]


def flip_byte(file: Path, offset: int) -> None:
    data = bytearray(file.read_bytes())
    data[offset] ^= 0xFF
    file.write_bytes(bytes(data))


def resume(tmp: Path, damage: Callable[[Path], None], overrides: list[str] = (), **kw) -> None:
    """Damage a copy of the saved checkpoint, then resume from it as a run would (``restore``)."""
    damage(copy_saved(tmp))
    manager(tmp / "run", list(overrides), **kw).restore()


def ckpt(id: str, damage: Callable[[Path], None], pattern: str, overrides: list[str] = (), **kw) -> Row:
    return Row(id, lambda tmp: resume(tmp, damage, overrides, **{k: v(tmp) if callable(v) else v for k, v in kw.items()}),
               CheckpointError, pattern)


def load_other(tmp: Path, saved_with: list[str], run_with: list[str], initial: bool = False) -> None:
    """Save with one model, load into another (resume, or ``initial_load_path``)."""
    path = manager(tmp / "src", saved_with).save(1, wait=True)
    if initial:
        manager(tmp / "run", run_with, initial_load_path=str(path), enable=False).restore()
    else:
        shutil.copytree(path.parent, tmp / "run" / "checkpoint")
        manager(tmp / "run", run_with).restore()


def rename_in_metadata(path: Path) -> None:
    """Change one letter of an entry name inside .metadata: still a valid pickle, no longer the saved file."""
    data = bytearray((path / ".metadata").read_bytes())
    at = data.index(b"tok_embeddings")
    data[at] ^= 0x20  # 't' -> 'T'
    (path / ".metadata").write_bytes(bytes(data))


def truncate(file: Path, keep: int) -> None:
    file.write_bytes(file.read_bytes()[:keep])


def rewrite_marker(path: Path, edit: Callable[[dict], None]) -> None:
    marker = json.loads((path / "COMPLETE.json").read_text())
    edit(marker)
    (path / "COMPLETE.json").write_text(json.dumps(marker))


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


# ----------------------------------------------------------------------------- environment


def with_env(var: str, value: str, overrides: list[str] | Callable[[Path], list[str]] = ()) -> Callable[[Path], None]:
    def act(tmp: Path) -> None:
        old = os.environ.get(var)
        os.environ[var] = value.format(tmp=tmp) if "{tmp}" in value else value
        if "{tmp}" in value:
            write(tmp / "a_file", "x")
        try:
            refuse(overrides(tmp) if callable(overrides) else list(overrides))
        finally:
            if old is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = old

    return act


# ----------------------------------------------------------------------------- the catalogue

CATALOGUE: list[Row] = [
    # --- config: value ranges
    config("steps_zero", ["training.steps=0"], r"^training\.steps=0 must be > 0$"),
    config("ft_min_replicas_above_groups", ["fault_tolerance=torchft", "fault_tolerance.min_replicas=3"],
           r"^fault_tolerance\.min_replicas=3 must be in \[1, replica_groups=2\]$"),
    config("ft_on_slurm", ["fault_tolerance=torchft", "cluster=slurm_local"],
           r"^fault_tolerance=torchft on SLURM runs one job per replica group: submit them as a sweep"),
    config("ft_group_without_lighthouse", ["fault_tolerance=torchft", "fault_tolerance.group=1"],
           r"^fault_tolerance\.group=1 starts that replica group on its own: it needs the Lighthouse"),
    config("ft_semi_sync_unknown", ["fault_tolerance=torchft", "fault_tolerance.semi_sync=gossip"],
           r"^fault_tolerance\.semi_sync='gossip' is not one of null, local_sgd, diloco$"),
    config("samples_from_a_language_model", ["eval.sample_every=10", "eval.sample_prompts=[a cat]"],
           r"eval\.sample_every=10: model family 'llama3' draws no sample pictures; set eval\.sample_every=0"),
    config("local_batch_zero", ["training.local_batch_size=0"], r"training\.local_batch_size=0 must be > 0"),
    config("seq_len_negative", ["training.seq_len=-8"], r"training\.seq_len=-8 must be > 0"),
    config("log_freq_zero", ["training.log_freq=0"], r"training\.log_freq=0 must be > 0"),
    config("val_steps_zero", ["training.val_steps=0"], r"training\.val_steps=0 must be > 0"),
    config("val_batch_zero", ["training.val_local_batch_size=0"], r"training\.val_local_batch_size=0 must be > 0"),
    config("global_batch_zero", ["training.global_batch_size=0"], r"global_batch_size=0 must be -1 .* or > 0"),
    config("global_batch_not_multiple", ["training.global_batch_size=6"], r"not a multiple of local_batch_size"),
    config("max_norm_negative", ["training.max_norm=-1"], r"training\.max_norm=-1\.0 must be >= 0"),
    config("lr_negative", ["optimizer.lr=-0.001"], r"optimizer\.lr=-0\.001 must be > 0"),
    config("weight_decay_negative", ["optimizer.weight_decay=-0.1"], r"optimizer\.weight_decay=-0\.1 must be >= 0"),
    config("betas_out_of_range", ["optimizer.betas=[0.9,1.5]"], r"optimizer\.betas=\[0\.9, 1\.5\] must each be within \[0, 1\)"),
    config("eps_negative", ["optimizer.eps=-1e-8"], r"optimizer\.eps=-1e-08 must be >= 0"),
    config("warmup_steps_beyond_run", ["training.steps=5", "lr_scheduler.warmup_steps=10"], r"warmup_steps=10 exceeds training\.steps=5"),
    config("warmup_fraction_above_one", ["lr_scheduler.warmup_fraction=1.5"], r"warmup_fraction=1\.5 must be within \[0, 1\]"),
    config("decay_ratio_negative", ["lr_scheduler.decay_ratio=-0.1"], r"decay_ratio=-0\.1 must be within \[0, 1\]"),
    config("min_lr_factor_above_one", ["lr_scheduler.min_lr_factor=2"], r"min_lr_factor=2\.0 must be within \[0, 1\]"),
    config("ckpt_interval_negative", ["checkpoint.interval=-1"], r"checkpoint\.interval=-1 must be >= 0"),
    config("ckpt_keep_negative", ["checkpoint.keep_latest_k=-1"], r"checkpoint\.keep_latest_k=-1 must be >= 0"),
    config("max_restarts_negative", ["cluster.max_restarts=-1"], r"cluster\.max_restarts=-1 must be >= 0"),
    config("threads_zero", ["cluster.threads_per_proc=0"], r"cluster\.threads_per_proc=0 must be > 0"),
    # checked in a one-process run too, although only a rendezvous uses it
    config("init_timeout_negative", ["cluster.init_timeout_s=-1"], r"cluster\.init_timeout_s=-1 must be > 0"),
    config("slurm_timeout_zero", ["cluster.timeout_min=0"], r"cluster\.timeout_min=0 must be > 0"),
    config("max_requeue_negative", ["cluster.max_requeue=-2"], r"cluster\.max_requeue=-2 must be >= 0"),
    config("profile_freq_zero", ["profiling.enable=true", "profiling.profile_freq=0"], r"profiling\.profile_freq=0 must be > 0"),
    config("val_fraction_one", ["data.val_fraction=1.0"], r"data\.val_fraction=1\.0 must be within \[0, 1\)"),
    config("max_documents_zero", ["data.max_documents=0"], r"data\.max_documents=0 must be > 0"),
    # health: each rule alone, naming its key and value
    config("spike_k_negative", ["health.spike_k=-1"], r"^health\.spike_k=-1\.0 must be > 0"),
    config("hang_timeout_negative", ["health.hang_timeout_s=-1"], r"^health\.hang_timeout_s=-1\.0 must be >= 0"),
    config("straggler_ratio_below_one", ["health.straggler_ratio=0.5"], r"^health\.straggler_ratio=0\.5 must be >= 1"),
    config("recheck_action_unknown", ["health.recheck_action=log"], r"^health\.recheck_action='log' is not one of stop, continue$"),
    # fault injection: a fault aimed at a rank the run does not have would run a drill with no fault
    config("slow_rank_beyond_world", ["fault_injection.slow_rank=5", "cluster.nproc_per_node=2", "parallelism=fsdp"],
           r"^fault_injection\.slow_rank=5 is not a rank of this run \(world size 2\)"),
    config("hang_rank_beyond_world", ["fault_injection.hang_rank=3"],
           r"^fault_injection\.hang_rank=3 is not a rank of this run \(world size 1\)"),
    config("bitflip_rank_beyond_world", ["fault_injection.bitflip_rank=1"],
           r"^fault_injection\.bitflip_rank=1 is not a rank of this run \(world size 1\)"),
    config("fault_rank_beyond_world", ["fault_injection.nan_at_step=2", "fault_injection.fault_rank=2"],
           r"^fault_injection\.fault_rank=2 is not a rank of this run \(world size 1\)"),
    # --- config: model shape and layout
    config("heads_do_not_divide_dim", ["model.n_heads=5"], r"not divisible by model\.n_heads=5"),
    config("odd_head_dim", ["model.dim=66", "model.n_heads=6"], r"head dim 11 must be even"),
    config("seq_len_beyond_model", ["model.max_seq_len=32"], r"training\.seq_len=64 exceeds model\.max_seq_len=32"),
    config("rope_theta_negative", ["model.rope_theta=-1"], r"model\.rope_theta=-1\.0 must be > 0"),
    config("norm_eps_zero", ["model.norm_eps=0"], r"model\.norm_eps=0\.0 must be > 0"),
    config("tp_beyond_world", ["parallelism.tp=2"], r"!= world size 1"),
    config("dp_shard_zero", ["parallelism.dp_shard=0"], r"parallelism\.dp_shard=0 must be >= 1 or -1"),
    config("tp_does_not_divide_kv_heads", ["parallelism=tp", "parallelism.tp=4", "cluster.nproc_per_node=4", "model.n_kv_heads=2"],
           r"parallelism\.tp=4 must divide model\.n_heads=4 and n_kv_heads=2"),
    config("cp_seq_len_split", ["parallelism=cp", "cluster.nproc_per_node=2", "training.seq_len=66"],
           r"seq_len=66 must be divisible by 2\*parallelism\.cp=4"),
    config("pp_with_tied_embeddings", ["model=qwen3_debug", "parallelism=pp", "cluster.nproc_per_node=2"],
           r"tie_word_embeddings=true cannot run under pipeline parallel"),
    config("pp_microbatches_zero", ["parallelism=pp", "cluster.nproc_per_node=2", "parallelism.pp_microbatches=0"],
           r"parallelism\.pp_microbatches=0 must be > 0"),
    config("seed_checkpoint_multi_rank", ["parallelism=fsdp", "cluster.nproc_per_node=2", "checkpoint.create_seed_checkpoint=true"],
           r"create_seed_checkpoint=true runs in one process"),
    config("exclude_unknown_category", ["checkpoint.exclude_from_loading=[weights]"], r"unknown entries \['weights'\]; use model, optimizer"),
    config("initial_load_path_missing", ["checkpoint.initial_load_path=/nonexistent/ckpt"], r"initial_load_path=/nonexistent/ckpt does not exist"),
    # --- environment
    config("cuda_without_gpu", ["cluster.device=cuda"], r"cluster\.device=cuda but no CUDA device is visible"),
    config("nccl_on_cpu", ["cluster.backend=nccl"], r"cluster\.backend=nccl needs CUDA"),
    Row("world_size_env_not_a_number", with_env("WORLD_SIZE", "two"), ConfigError, r"WORLD_SIZE='two' in the environment is not a positive integer"),
    Row("world_size_env_zero", with_env("WORLD_SIZE", "0"), ConfigError, r"WORLD_SIZE='0' in the environment is not a positive integer"),
    Row("world_size_env_disagrees", with_env("WORLD_SIZE", "3", ["parallelism=tp"]), ConfigError, r"world size 3"),
    Row("run_dir_below_a_file", lambda tmp: check_writable_dir(blocked(tmp), "hydra.run.dir"), ConfigError,
        r"hydra\.run\.dir=.*/a_file/sub is not a writable directory \(Not a directory\)"),
    Row("checkpoint_folder_below_a_file", lambda tmp: refuse(["checkpoint=default", f"checkpoint.folder={blocked(tmp)}"]),
        ConfigError, r"checkpoint\.folder=.*/a_file/sub is not a writable directory"),
    Row("checkpoint_folder_in_unwritable_run_dir", lambda tmp: manager(blocked(tmp)), ConfigError,
        r"checkpoint\.folder=.*/a_file/sub/checkpoint is not a writable directory"),
    files("token_cache_below_a_file", lambda tmp: text_data(tmp, "some words " * 300) + [f"data.cache_dir={blocked(tmp)}"],
          r"token cache .*/a_file/sub is not writable .*set data\.cache_dir"),
    Row("token_cache_env_below_a_file", with_env("TITAN_HYDRA_CACHE", "{tmp}/a_file/cache",
                                                 lambda tmp: text_data(tmp, "other words " * 300)),
        DataError, r"token cache .*/a_file/cache is not writable"),
    # --- data files
    config("json_without_path", ["data=json"], r"data\.source=json needs a file: set data\.path="),
    config("data_path_missing", ["data=json", "data.path=/nonexistent/d.jsonl"], r"data\.path=/nonexistent/d\.jsonl does not exist"),
    config("hf_without_name", ["data.source=hf"], r"data\.source=hf needs data\.hf_name"),
    # refused by validate (dataset.check_settings) before any data is read
    config("streaming_builtin", ["data.streaming=true"], r"streaming=true is not supported for the builtin corpus"),
    config("prepared_not_a_directory", ["data=prepared", "data.path=/nonexistent/prepared"],
           r"^data\.source=prepared needs data\.path=<a directory recipes/prepare_data\.py wrote>; /nonexistent/prepared is not one$"),
    files("empty_json_file", lambda tmp: json_data(tmp, ""), r"data file .*/d\.jsonl is empty"),
    files("blank_text_file", lambda tmp: text_data(tmp, "\n\n   \n"), r"data file .*/d\.txt is empty"),
    files("binary_json_file", lambda tmp: json_data(tmp, bytes(range(256)) * 8), r"data file .*/d\.jsonl is binary \(a NUL byte at offset 0\)"),
    files("binary_text_file", lambda tmp: text_data(tmp, b"PK\x03\x04" + b"\x00" * 64), r"data file .*/d\.txt is binary \(a NUL byte at offset 4\)"),
    files("latin1_text_file", lambda tmp: text_data(tmp, "caf\xe9 au lait ".encode("latin-1") * 50),
          r"data file .*/d\.txt is not UTF-8 text \(invalid byte at offset 3\)"),
    files("utf8_cut_at_end", lambda tmp: text_data(tmp, ("déjà vu " * 40).encode()[:-1] + b"\xc3"),
          r"data file .*/d\.txt is not UTF-8 text \(it ends inside a character\)"),
    files("gz_cut_short", lambda tmp: json_data(tmp, gzip.compress(DOCS.encode())[:200], "d.jsonl.gz"),
          r"data file .*/d\.jsonl\.gz cannot be read \(Compressed file ended before the end-of-stream marker"),
    files("gz_that_is_not_gzip", lambda tmp: json_data(tmp, DOCS, "d.jsonl.gz"), r"data file .*/d\.jsonl\.gz cannot be read \(Not a gzipped file"),
    files("parquet_that_is_not_parquet", lambda tmp: ["data=parquet", f"data.path={write(tmp / 'd.parquet', DOCS)}"],
          r"could not load parquet files .*Parquet magic bytes not found"),
    files("empty_parquet_file", lambda tmp: ["data=parquet", f"data.path={write(tmp / 'd.parquet', b'')}"], r"data file .*/d\.parquet is empty \(0 bytes\)"),
    files("parquet_without_text_column", lambda tmp: parquet(tmp, "body"), r"missing text field 'text'; columns are \['body'\]"),
    files("invalid_json_line", lambda tmp: json_data(tmp, DOCS + "{not json}\n"), r"bad record in .*/d\.jsonl line 41: invalid JSON"),
    files("json_record_not_object", lambda tmp: json_data(tmp, DOCS + "[1, 2]\n"), r"line 41: expected a JSON object, got list"),
    files("json_array_of_numbers", lambda tmp: json_data(tmp, "[1, 2]\n"), r"record 1: expected a JSON object, got int"),
    files("json_missing_text_field", lambda tmp: json_data(tmp, jsonl([{"body": "x"}])), r"line 1: missing text field 'text' \(set data\.text_field"),
    files("json_text_not_string", lambda tmp: json_data(tmp, jsonl([{"text": 7}])), r"text field 'text' is int, expected a string"),
    files("json_all_texts_empty", lambda tmp: json_data(tmp, jsonl([{"text": "  "}] * 5)), r"split 'train' has 0 tokens, fewer than one sample"),
    files("directory_without_data_files", lambda tmp: ["data=json", f"data.path={write(tmp / 'd' / 'notes.md', 'x').parent}"],
          r"no json files found at data\.path=.*/d \(give a file"),
    files("glob_matches_nothing", lambda tmp: ["data=json", f"data.path={tmp}/*.jsonl"], r"no json files found at data\.path=.*\*\.jsonl"),
    files("val_path_matches_nothing", lambda tmp: json_data(tmp, DOCS) + [f"data.val_path={tmp}/val/*.jsonl"],
          r"no json files found at data\.val_path="),
    files("too_short_for_one_sample", lambda tmp: text_data(tmp, "hello world"), r"split 'train' has \d+ tokens, fewer than one sample of seq_len\+1=65"),
    files("val_split_smaller_than_a_batch", lambda tmp: json_data(tmp, DOCS) + ["data.max_documents=null", "data.val_fraction=0.03"],
          r"split 'val' has \d+ samples, fewer than one global batch of 4"),
    # --- tokenizer
    config("tokenizer_path_missing", ["data.tokenizer=/nonexistent/tok.json"], r"data\.tokenizer=/nonexistent/tok\.json does not exist"),
    files("tokenizer_dir_without_json", lambda tmp: [f"data.tokenizer={write(tmp / 'tok' / 'README', 'x').parent}"],
          r"tokenizer not found: .*/tok/tokenizer\.json"),
    files("tokenizer_not_json", lambda tmp: [f"data.tokenizer={write(tmp / 'tok.json', '{broken')}"], r"invalid tokenizer file .*/tok\.json"),
    files("tokenizer_config_not_json", lambda tmp: tokenizer_dir(tmp, "{broken"), r"invalid tokenizer config .*/tokenizer_config\.json"),
    files("tokenizer_without_bos", lambda tmp: tokenizer_dir(tmp, json.dumps({"bos_token": "<s>"})), r"has no BOS token '<s>'"),
    config("tokenizer_vocab_beyond_model", ["model.vocab_size=1000"], r"tokenizer vocab \d+ exceeds model\.vocab_size=1000"),
    # --- checkpoints
    ckpt("corrupted_shard", lambda p: flip_byte(shard(p), 100), r"file __0_0\.distcp is corrupted \(CRC-32 [0-9a-f]{8}, the completion marker recorded [0-9a-f]{8}\)"),
    ckpt("truncated_shard", lambda p: truncate(shard(p), 1000), r"data file __0_0\.distcp is truncated \(1000 bytes, needs \d+\)"),
    ckpt("shard_grown", lambda p: shard(p).write_bytes(shard(p).read_bytes() + b"\0"), r"file __0_0\.distcp has \d+ bytes, the completion marker recorded \d+"),
    ckpt("shard_missing", lambda p: shard(p).unlink(), r"data file __0_0\.distcp is missing"),
    ckpt("metadata_missing", lambda p: (p / ".metadata").unlink(), r"step-3: no DCP \.metadata file \(not a DCP checkpoint directory\)"),
    ckpt("metadata_entry_renamed", rename_in_metadata, r"file \.metadata is corrupted \(CRC-32"),
    ckpt("metadata_grown", lambda p: (p / ".metadata").write_bytes((p / ".metadata").read_bytes() + b"\n"),
         r"file \.metadata has \d+ bytes, the completion marker recorded \d+"),
    ckpt("metadata_not_a_pickle", lambda p: (p / ".metadata").write_bytes(b"\x89PNG\r\n"), r"\.metadata is unreadable or not DCP metadata"),
    ckpt("metadata_hostile_pickle", lambda p: (p / ".metadata").write_bytes(pickle.dumps(Evil())),
         r"\.metadata is unreadable or not DCP metadata \(refusing to load posix\.system\)"),
    ckpt("marker_unreadable", lambda p: (p / "COMPLETE.json").write_text("{half"), r"completion marker COMPLETE\.json is unreadable"),
    ckpt("loader_seq_len_changed", lambda p: None, r"data loader state does not match this data: seq_len was 16, now 32",
         loader=lambda tmp: packed_loader(seq_len=32)),
    ckpt("loader_other_data", lambda p: None, r"data loader state does not match this data: num_samples was 249, now 124",
         loader=lambda tmp: packed_loader(tokens=2000)),
    ckpt("streaming_world_size_changed", lambda p: rewrite_marker(p, lambda m: m.update(world_size=2, layout={**m["layout"], "dp_shard": 2})),
         r"saved by 2 rank\(s\) \(dp_shard=2\), this run has 1 \(no parallelism\): a streaming data position cannot be resharded",
         loader=streaming_loader),
    ckpt("load_step_missing", lambda p: None, r"checkpoint\.load_step=7: .*step-7 is missing or incomplete", load_step=7),
    Row("model_only_loaded_as_full", lambda tmp: model_only_as_full(tmp), CheckpointError, r"step-2 is a model-only export \(no optimizer or training state\); load it with checkpoint\.initial_load_model_only=true"),
    Row("checkpoint_from_another_family", lambda tmp: load_other(tmp, ["model=qwen3_debug", "model.dim=64", "model.n_layers=2", "model.n_heads=4"], []),
        CheckpointError, r"saved from a different model .*family='qwen3' \(run has 'llama3'\)"),
    Row("checkpoint_from_another_vocab", lambda tmp: load_other(tmp, ["model.vocab_size=4096"], [], initial=True),
        CheckpointError, r"saved from a different model .*vocab_size=4096 \(run has 2048\)"),
    Row("checkpoint_from_deeper_model", lambda tmp: load_other(tmp, ["model.n_layers=3"], []),
        CheckpointError, r"n_layers=3 \(run has 2\)"),
    Row("initial_load_without_complete_checkpoint", lambda tmp: manager(tmp / "run", initial_load_path=str(write(tmp / "empty" / "notes", "x").parent),
                                                                         enable=False).restore(),
        CheckpointError, r"initial_load_path=.*/empty holds no complete checkpoint"),
]


def model_only_as_full(tmp: Path) -> None:
    """A model-only export (no optimizer, no 'extra') loaded as a full state."""
    m = manager(tmp / "src")
    path = m.save(2, model_only=True, wait=True)
    manager(tmp / "run").load(path, model_only=False)


def test_catalogue_is_large_and_unique():
    ids = [r.id for r in CATALOGUE]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    assert len(ids) >= 60, len(ids)


@pytest.mark.parametrize("row", CATALOGUE, ids=[r.id for r in CATALOGUE])
def test_bad_input_is_refused_in_one_line(row: Row, tmp_path, monkeypatch):
    monkeypatch.setenv("TITAN_HYDRA_CACHE", str(tmp_path / "token_cache"))
    with pytest.raises(UserError) as info:
        row.act(tmp_path)
    message = str(info.value)
    assert isinstance(info.value, row.error), f"{type(info.value).__name__}: {message}"
    assert "\n" not in message.strip(), message
    assert len(message) < 400, message
    assert re.search(row.pattern, message), message


def test_refused_checkpoint_leaves_the_model_untouched(tmp_path):
    """A corrupted shard is found before any tensor is read: the run's weights stay as they were."""
    path = copy_saved(tmp_path)
    flip_byte(shard(path), 100)
    m = manager(tmp_path / "other")
    with torch.no_grad():
        for p in m.model_parts[0].parameters():
            p.fill_(0.5)
    with pytest.raises(CheckpointError, match="is corrupted"):
        m.load(path)
    assert all(torch.all(p == 0.5) for p in m.model_parts[0].parameters())


# ----------------------------------------------------------------------------- end to end
# Each launch costs ~4 s of process start-up; two run at a time.


def _launch(args: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", **(env or {})}
    return subprocess.run([sys.executable, str(REPO / "launch.py"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=full_env)


def _corrupted_resume(tmp: Path) -> list[str]:
    """A run dir whose only checkpoint (saved by a 2-step run in this process) has a flipped byte."""
    from titan_hydra.train.pretrain import run

    args = TINY + ["logger=minimal", "checkpoint=default", "training.val_freq=0", "cluster.threads_per_proc=1"]
    run_dir = tmp / "run"
    run_dir.mkdir(parents=True)
    run(spec_of(compose_cfg(args + ["training.steps=2"])), str(run_dir))
    flip_byte(shard(run_dir / "checkpoint" / "step-2"), 64)
    return args + ["training.steps=4", f"hydra.run.dir={run_dir}"]


LAUNCHED = {
    "run_dir_below_a_file": (lambda tmp: [f"hydra.run.dir={blocked(tmp)}"], {},
                             r"hydra\.run\.dir=.*/a_file/sub is not a writable directory"),
    "binary_data_file": (lambda tmp: text_data(tmp, b"\x7fELF\x00\x01") + [f"hydra.run.dir={tmp / 'run'}"], {},
                         r"data file .*/d\.txt is binary"),
    "world_size_env_not_a_number": (lambda tmp: [f"hydra.run.dir={tmp / 'run'}"], {"WORLD_SIZE": "two"},
                                    r"WORLD_SIZE='two' in the environment is not a positive integer"),
    "corrupted_checkpoint_on_resume": (_corrupted_resume, {}, r"checkpoint .*/step-2: file __0_0\.distcp is corrupted"),
    "init_timeout_negative_one_process": (lambda tmp: ["cluster.init_timeout_s=-1", f"hydra.run.dir={tmp / 'run'}"],
                                          {}, r"cluster\.init_timeout_s=-1 must be > 0"),
}


@pytest.mark.slow
def test_an_experiment_that_does_not_exist_fails_while_composing(tmp_path):
    """A typo in experiment=... used to train the default Llama silently (an ``optional`` default)."""
    proc = _launch(["experiment=flux_debugg", "logger=minimal", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode != 0 and not (tmp_path / "run").exists()
    assert "Could not find 'experiment/flux_debugg'" in proc.stderr
    listed = re.findall(r"^\t(\S+)$", proc.stderr, re.M)  # Hydra lists the available options
    assert set(listed) == {p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml")}, proc.stderr


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    def one(name: str) -> subprocess.CompletedProcess:
        make, env, _ = LAUNCHED[name]
        tmp = tmp_path_factory.mktemp(name)
        return _launch(make(tmp) + ["logger=minimal"], cwd=tmp, env=env)

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(LAUNCHED, pool.map(one, LAUNCHED)))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAUNCHED))
def test_launch_refuses_in_one_line_without_traceback(name, launched):
    proc = launched[name]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], proc.stderr[-3000:]
    assert re.search(LAUNCHED[name][2], errors[0]), errors[0]


def test_float8_without_torchao_is_one_line(monkeypatch):
    """A broken install (torchao missing) fails while validating, not with a traceback at model build."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(ConfigError, match=r"^float8=tensorwise needs torchao, which is not installed; pip install"):
        validate(compose_cfg(["float8=tensorwise"]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a visible GPU")
def test_a_rank_asks_the_same_device_rules_as_validate():
    """A rank may start where validate did not run (a SLURM node): it asks runtime.device's rules
    again, and says what validate would have said."""
    from titan_hydra.train.pretrain import init_distributed, setup_device

    for overrides, call in ((["cluster.device=cuda"], lambda c: setup_device(c, 0)),
                            (["cluster.backend=nccl"], lambda c: init_distributed(c, world_size=2))):
        cfg = compose_cfg(overrides)
        with pytest.raises(ConfigError) as at_validate:
            validate(cfg)
        with pytest.raises(ConfigError) as on_the_rank:
            call(cfg.cluster)
        assert str(on_the_rank.value) == str(at_validate.value)
