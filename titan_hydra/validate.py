"""Cross-field rules the schema cannot express, checked before any process starts.

Each rule raises ConfigError with one line: what is wrong, and which key fixes it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from titan_hydra.checkpoint.resume import branch_point
from titan_hydra.checkpoint.state import CATEGORIES
from titan_hydra.checkpoint.storage import CheckpointError
from titan_hydra.data import dataset as token_data
from titan_hydra.data.mixture import check_sources
from titan_hydra.data.tokenizer import Tokenizer
from titan_hydra.errors import ConfigError, DataError, check_writable_dir  # check_writable_dir: also imported from here
from titan_hydra.layout import check_layout
from titan_hydra.planner.fit import check_memory_fits
from titan_hydra.runtime.device import check_backend, check_device, check_start_method
from titan_hydra.spec import RunSpec, spec_of


def _positive(cfg: DictConfig, key: str, allow_zero: bool = False) -> None:
    value = OmegaConf.select(cfg, key)
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{key}={value} must be {bound}")


def validate(cfg: DictConfig, environment: bool = True) -> RunSpec:
    """The run's RunSpec, or ConfigError on the first broken rule. ``environment=False`` (and a dry
    run) skips what only the machine that runs it can answer: devices, start method, local paths."""
    _validate_counts(cfg)
    _validate_schedule(cfg.training, cfg.lr_scheduler)
    spec = spec_of(cfg)  # every group built once: degrees vs world size, the model node, each group's own rules
    check_layout(spec)
    if spec.data.document_mask:
        _validate_document_mask(spec.family, spec.dims)
    here = environment and not spec.dry_run  # a dry run sizes a GPU cluster from any machine
    if here:
        _validate_environment(spec)
        check_memory_fits(spec)  # before anything is built: a model this machine cannot hold is one line
    if spec.token_data:  # (image data checks itself on build)
        _validate_data(cfg, spec.shape.vocab_size)
    if spec.eval.enabled:
        spec.eval.check(spec.family)  # lm-eval installed, tasks known, pictures drawable: before any model
    _validate_ranges(cfg)
    if getattr(spec.lr_scheduler, "branches_off_a_checkpoint", False):  # lr_scheduler=cooldown
        _validate_branch(cfg.checkpoint, spec.training.steps, local_paths=here)
    _validate_checkpoint(cfg.checkpoint, spec.world_size, local_paths=here)
    _validate_fault_tolerance(cfg)
    spec.fault_injection.check_ranks(spec.world_size)  # the health settings' own rules ran in spec_of
    _validate_float8(cfg)
    return spec


def _validate_counts(cfg: DictConfig) -> None:
    for key in ("training.steps", "training.local_batch_size", "training.seq_len", "training.log_freq",
                "training.val_steps", "cluster.nproc_per_node", "cluster.nnodes", "optimizer.lr",
                "model.dim", "model.n_layers", "model.n_heads", "model.vocab_size"):
        _positive(cfg, key)
    for key in ("training.max_norm", "training.val_freq", "lr_scheduler.warmup_steps", "checkpoint.interval",
                "checkpoint.keep_latest_k"):
        _positive(cfg, key, allow_zero=True)


def _validate_schedule(t: DictConfig, s: DictConfig) -> None:
    if not 0.0 <= t.ema_decay < 1.0:
        raise ConfigError(f"training.ema_decay={t.ema_decay} must be within [0, 1): 0 keeps no EMA of the weights, "
                          "0.999 averages over about the last 1000 steps")
    if not 0.0 <= s.min_lr_factor <= 1.0:
        raise ConfigError(f"lr_scheduler.min_lr_factor={s.min_lr_factor} must be within [0, 1]")
    if "warmup_fraction" not in s:  # lr_scheduler=cooldown: no warmup or decay ratio (_validate_branch)
        return
    if not 0.0 <= s.warmup_fraction <= 1.0:
        raise ConfigError(f"lr_scheduler.warmup_fraction={s.warmup_fraction} must be within [0, 1]")
    if s.warmup_steps is not None and s.warmup_steps > t.steps:
        raise ConfigError(
            f"lr_scheduler.warmup_steps={s.warmup_steps} exceeds training.steps={t.steps}; lower it or set "
            "lr_scheduler.warmup_steps=null (warmup_fraction of the run)"
        )
    if s.decay_ratio is not None and not 0.0 <= s.decay_ratio <= 1.0:
        raise ConfigError(f"lr_scheduler.decay_ratio={s.decay_ratio} must be within [0, 1]")


def _validate_float8(cfg: DictConfig) -> None:
    """float8 converts through torchao: a missing one is one line now, not a traceback at model build."""
    if str(cfg.float8.recipe) != "none" and importlib.util.find_spec("torchao") is None:
        raise ConfigError(f"float8={cfg.float8.recipe} needs torchao, which is not installed; "
                          "pip install torchao==0.18.0, or float8=none")


def _validate_fault_tolerance(cfg: DictConfig) -> None:
    ft = cfg.fault_tolerance
    if ft.name == "none":  # (its own value rules were spec_of's, when it built the group)
        return
    if cfg.training.ema_decay > 0:
        raise ConfigError(f"training.ema_decay={cfg.training.ema_decay} with fault_tolerance={ft.name}: a replica "
                          "group recovering from a live peer would not receive its EMA; set training.ema_decay=0")
    if ft.group is not None and not ft.lighthouse:
        raise ConfigError(f"fault_tolerance.group={ft.group} starts that replica group on its own: it needs the "
                          "Lighthouse every group meets at, fault_tolerance.lighthouse=http://host:port "
                          "(start one with: torchft_lighthouse --min_replicas 1 --bind 0.0.0.0:29510)")
    if cfg.cluster.launcher == "slurm" and ft.group is None:
        raise ConfigError("fault_tolerance=torchft on SLURM runs one job per replica group: submit them as a sweep, "
                          "-m fault_tolerance.group=0,1,... with fault_tolerance.lighthouse=http://host:port of a "
                          "Lighthouse you run beside them (torchft_lighthouse --bind 0.0.0.0:<port>)")


def _validate_document_mask(family, dims) -> None:
    if not family.supports_document_mask:
        raise ConfigError(f"data.document_mask=true: model family {family.name!r} does not take document ids "
                          "(its ModelFamily.supports_document_mask is false); set data.document_mask=false")
    if dims.cp > 1:
        raise ConfigError(f"data.document_mask=true is not supported with parallelism.cp={dims.cp} (context "
                          "parallel's ring attention has only the plain causal mask); use parallelism.cp=1 "
                          "or data.document_mask=false")


def _validate_environment(spec: RunSpec) -> None:
    """The machine's answers: a visible GPU, a start method and backend it can use."""
    device, c = str(spec.cluster.device), spec.cluster
    check_device(device)
    check_start_method(device, str(c.start_method))
    check_backend(device, str(c.backend))


def _validate_data(cfg: DictConfig, vocab: int) -> None:
    """The data owners' own rules (``dataset.check_settings``, ``mixture.check_sources``), asked
    before any process starts, then the tokenizer against the model's vocabulary."""
    try:
        _check_data_sources(cfg.data)
    except DataError as e:
        raise ConfigError(str(e)) from None
    _validate_tokenizer(str(cfg.data.tokenizer), vocab)


def _check_data_sources(d: DictConfig) -> None:
    if "sources" in d:  # data=mixture
        check_sources(OmegaConf.to_container(d.sources, resolve=True) if d.get("sources") is not None else {})
    elif "source" in d:
        token_data.check_settings(str(d.source), _given(d, "path"), int(d.seq_len), float(d.val_fraction),
                                  _given(d, "hf_name"), bool(d.streaming))


def _given(node: DictConfig, key: str) -> str | None:
    """``node.key`` as a string, or None where it is unset (``???``) or null."""
    if key not in node or OmegaConf.is_missing(node, key) or node[key] is None:
        return None
    return str(node[key])


def _validate_tokenizer(tokenizer: str, vocab: int) -> None:
    if tokenizer != "builtin" and not Path(tokenizer).expanduser().exists():
        raise ConfigError(f"data.tokenizer={tokenizer} does not exist; give a tokenizer.json file or its directory")
    tok = Tokenizer(tokenizer)
    if tok.vocab_size > vocab:
        raise ConfigError(f"tokenizer vocab {tok.vocab_size} exceeds model.vocab_size={vocab}; "
                          "raise model.vocab_size or use a smaller tokenizer")


# --------------------------------------------------------------------------- value ranges, checkpoint, run dir
# Keys a family or option may lack are looked up with OmegaConf.select (absent: not checked).
# Every key is checked whatever the layout: cluster.init_timeout_s matters only once a rendezvous
# happens, but a one-process run that accepts -1 teaches the user it was fine.
POSITIVE = ("training.val_local_batch_size", "cluster.threads_per_proc", "parallelism.pp_microbatches",
            "model.rope_theta", "model.norm_eps", "data.max_documents", "cluster.init_timeout_s",
            "cluster.timeout_min")
NON_NEGATIVE = ("cluster.max_restarts", "optimizer.weight_decay", "optimizer.eps", "cluster.max_requeue",
                "cluster.signal_delay_s")


def _validate_ranges(cfg: DictConfig) -> None:
    """Values a constructor would refuse with a traceback (AdamW betas) or accept and go wrong with
    (a negative rope_theta trains on NaNs), refused before anything is built."""
    for key in POSITIVE:
        _positive(cfg, key)
    for key in NON_NEGATIVE:
        _positive(cfg, key, allow_zero=True)
    gbs = cfg.training.global_batch_size
    if gbs != -1 and gbs < 1:
        raise ConfigError(f"training.global_batch_size={gbs} must be -1 (local batch x data parallel) or > 0")
    betas = OmegaConf.select(cfg, "optimizer.betas")
    if betas is not None and not all(0.0 <= float(b) < 1.0 for b in betas):
        raise ConfigError(f"optimizer.betas={list(betas)} must each be within [0, 1)")
    p = cfg.profiling
    if p.enable:
        for key in ("profile_freq", "active"):
            _positive(cfg, f"profiling.{key}")
        _positive(cfg, "profiling.warmup", allow_zero=True)


def _validate_branch(c: DictConfig, steps: int, local_paths: bool) -> None:
    """``lr_scheduler=cooldown``: a full-state start from a stable run's checkpoint, before its end."""
    if not c.initial_load_path:
        raise ConfigError("lr_scheduler=cooldown branches off a stable run's checkpoint: set "
                          "checkpoint.initial_load_path=<base run>/checkpoint/step-S (experiment=anneal_branches)")
    if c.initial_load_model_only:
        raise ConfigError("lr_scheduler=cooldown continues the base run's optimizer and data position: set "
                          "checkpoint.initial_load_model_only=false")
    if not local_paths:
        return
    try:
        step = branch_point(c.initial_load_path)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    if step >= steps:
        raise ConfigError(f"lr_scheduler=cooldown: the branch point (step {step} of {c.initial_load_path}) is not "
                          f"before training.steps={steps}; set training.steps to the branch point + the cooldown steps")


def _validate_checkpoint(c: DictConfig, world_size: int, local_paths: bool) -> None:
    unknown = sorted(set(c.exclude_from_loading or []) - set(CATEGORIES))
    if unknown:
        raise ConfigError(f"checkpoint.exclude_from_loading has unknown entries {unknown}; use {', '.join(CATEGORIES)}")
    if c.create_seed_checkpoint and world_size != 1:
        raise ConfigError("checkpoint.create_seed_checkpoint=true runs in one process: set "
                          "cluster.nproc_per_node=1 and parallelism=single")
    if not local_paths:  # a plan for another machine: its paths need not exist here
        return
    if c.initial_load_path and not Path(c.initial_load_path).expanduser().exists():
        raise ConfigError(f"checkpoint.initial_load_path={c.initial_load_path} does not exist; point it at a "
                          "checkpoint directory or set it to null")
    if c.enable and Path(c.folder).is_absolute():
        check_writable_dir(c.folder, "checkpoint.folder")


def check_run_dir(config: DictConfig, key: str = "hydra.run.dir") -> None:
    """The run (or sweep) dir Hydra is about to create, checked before it tries: Hydra's own
    mkdir would fail with a traceback. Prints one ``error:`` line and exits 2."""
    import sys

    path = OmegaConf.select(config, key)
    if path is None:
        return
    try:
        check_writable_dir(path, key)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


class RunDirCheck(Callback):
    """Hydra callback (conf/config.yaml, hydra.callbacks): ``check_run_dir`` at run / sweep start."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        check_run_dir(config, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        check_run_dir(config, "hydra.sweep.dir")
