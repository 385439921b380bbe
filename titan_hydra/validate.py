"""Cross-field rules the schema cannot express, checked before any process starts.

Each rule raises ConfigError with one line: what is wrong, and which key fixes it.
"""

from __future__ import annotations

import os
from pathlib import Path

from titan_hydra.errors import instantiate_checked as instantiate
from omegaconf import DictConfig, OmegaConf

from titan_hydra.errors import ConfigError


def _positive(cfg: DictConfig, key: str, allow_zero: bool = False) -> None:
    value = OmegaConf.select(cfg, key)
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{key}={value} must be {bound}")


def world_size_of(cfg: DictConfig) -> int:
    """World size: under torchrun/SLURM the environment says; otherwise the cluster config."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return int(cfg.cluster.nnodes) * int(cfg.cluster.nproc_per_node)


def build_dims(cfg: DictConfig):
    return instantiate(cfg.parallelism, world_size=world_size_of(cfg), _convert_="all")


def validate(cfg: DictConfig) -> None:
    """Raise ConfigError on the first broken rule."""
    for key in ("training.steps", "training.local_batch_size", "training.seq_len", "training.log_freq",
                "training.val_steps", "cluster.nproc_per_node", "cluster.nnodes", "optimizer.lr",
                "model.dim", "model.n_layers", "model.n_heads", "model.vocab_size"):
        _positive(cfg, key)
    for key in ("training.max_norm", "training.val_freq", "lr_scheduler.warmup_steps", "checkpoint.interval",
                "checkpoint.keep_latest_k"):
        _positive(cfg, key, allow_zero=True)

    t, s = cfg.training, cfg.lr_scheduler
    if not 0.0 <= s.warmup_fraction <= 1.0:
        raise ConfigError(f"lr_scheduler.warmup_fraction={s.warmup_fraction} must be within [0, 1]")
    if s.warmup_steps is not None and s.warmup_steps > t.steps:
        raise ConfigError(
            f"lr_scheduler.warmup_steps={s.warmup_steps} exceeds training.steps={t.steps}; lower it or set "
            "lr_scheduler.warmup_steps=null (warmup_fraction of the run)"
        )
    if s.decay_ratio is not None and not 0.0 <= s.decay_ratio <= 1.0:
        raise ConfigError(f"lr_scheduler.decay_ratio={s.decay_ratio} must be within [0, 1]")
    if not 0.0 <= s.min_lr_factor <= 1.0:
        raise ConfigError(f"lr_scheduler.min_lr_factor={s.min_lr_factor} must be within [0, 1]")

    from titan_hydra.models.registry import args_of

    family, args = args_of(cfg.model)  # the family's own shape rules (heads, head dim, ...)
    dims = build_dims(cfg)
    family.check(args, dims, int(t.seq_len))  # layout rules of this family (tp vs heads, pp vs tying, ...)
    if dims.cp > 1 and t.seq_len % (2 * dims.cp) != 0:
        raise ConfigError(
            f"training.seq_len={t.seq_len} must be divisible by 2*parallelism.cp={2 * dims.cp} "
            "(causal load balancing splits each sequence into 2*cp chunks)"
        )
    dims.batch_plan(t.local_batch_size, t.global_batch_size)

    if not OmegaConf.select(cfg, "dry_run"):  # a dry run sizes a GPU cluster from any machine
        _validate_environment(cfg)
    _validate_parallel_modules(cfg, dims)
    _validate_data(cfg)


PARALLEL_MODULES = ("fsdp", "tp", "pp", "cp", "ac", "compile")


def _validate_parallel_modules(cfg: DictConfig, dims) -> None:
    """Each parallelism module may define ``check_config(cfg, dims)`` for its own rules."""
    import importlib

    for name in PARALLEL_MODULES:
        try:
            module = importlib.import_module(f"titan_hydra.parallel.{name}")
        except ModuleNotFoundError:
            continue
        check = getattr(module, "check_config", None)
        if check is not None:
            check(cfg, dims)


def _validate_environment(cfg: DictConfig) -> None:
    import torch

    c = cfg.cluster
    if c.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("cluster.device=cuda but no CUDA device is visible; use cluster=local_cpu")
    if c.device == "cpu" and c.backend == "nccl":
        raise ConfigError("cluster.backend=nccl needs CUDA; use cluster.backend=gloo on CPU")


def family_vocab(cfg: DictConfig) -> int:
    from titan_hydra.models.registry import args_of

    family, args = args_of(cfg.model)
    return family.shape(args).vocab_size


def _validate_data(cfg: DictConfig) -> None:
    d = cfg.data
    if d.source in ("json", "parquet", "text"):
        if OmegaConf.is_missing(d, "path") or not d.path:
            raise ConfigError(f"data={d.name} needs a file: set data.path=<file, directory or glob>")
        path = Path(d.path).expanduser()
        if not any(ch in d.path for ch in "*?[") and not path.exists():
            raise ConfigError(f"data.path={d.path} does not exist")
    if d.source == "hf" and not d.hf_name:
        raise ConfigError("data.source=hf needs data.hf_name (e.g. allenai/c4)")
    if d.tokenizer != "builtin" and not Path(d.tokenizer).expanduser().exists():
        raise ConfigError(
            f"data.tokenizer={d.tokenizer} does not exist; give a tokenizer.json file or its directory"
        )
    from titan_hydra.data.tokenizer import Tokenizer

    tok = Tokenizer(d.tokenizer)
    vocab = family_vocab(cfg)
    if tok.vocab_size > vocab:
        raise ConfigError(
            f"tokenizer vocab {tok.vocab_size} exceeds model.vocab_size={vocab}; "
            "raise model.vocab_size or use a smaller tokenizer"
        )
