"""Cross-field rules the schema cannot express, checked on the run's ``RunSpec`` before any process starts.

``spec_of`` reads the composed config once, into typed settings, refusing a value no setting
can hold (each settings class's own rules: ``training_of``, ``cluster_of``, ``OptimizerSettings``,
``Health``, ...); ``check_spec`` then asks every rule that spans settings, reading the spec only.
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
from titan_hydra.data.settings import DataSettings
from titan_hydra.data.tokenizer import Tokenizer
from titan_hydra.errors import ConfigError, DataError, check_writable_dir  # check_writable_dir: also imported from here
from titan_hydra.layout import check_layout
from titan_hydra.planner.fit import check_memory_fits
from titan_hydra.runtime.device import check_backend, check_device, check_start_method
from titan_hydra.schedules import CooldownSchedule, check_branch_point
from titan_hydra.spec import RunSpec, check_positive, spec_of


def validate(cfg: DictConfig, environment: bool = True) -> RunSpec:
    """The RunSpec of a composed config, or ConfigError on the first broken rule (``check_spec``)."""
    return check_spec(spec_of(cfg), environment)


def check_spec(spec: RunSpec, environment: bool = True) -> RunSpec:
    """``spec``, or ConfigError on the first broken rule. ``environment=False`` (and a dry run) skips
    what only the machine that runs it can answer: devices, start method, local paths."""
    spec.lr_scheduler.check(spec.training.steps)
    check_layout(spec)
    if spec.data.document_mask:
        _validate_document_mask(spec.family, spec.dims)
    here = environment and not spec.dry_run  # a dry run sizes a GPU cluster from any machine
    if here:
        _validate_environment(spec)
        check_memory_fits(spec)  # before anything is built: a model this machine cannot hold is one line
    if spec.token_data:  # (image data checks itself on build)
        _validate_data(spec.data, spec.shape.vocab_size)
    if spec.eval.enabled:
        _validate_eval(spec)
    _validate_ranges(spec)
    if isinstance(spec.lr_scheduler, CooldownSchedule):
        _validate_branch(spec, local_paths=here)
    _validate_checkpoint(spec, local_paths=here)
    _validate_fault_tolerance(spec)
    spec.fault_injection.check_ranks(spec.world_size)  # the health settings' own rules ran in spec_of
    _validate_float8(spec)
    return spec


def _validate_float8(spec: RunSpec) -> None:
    """float8 converts through torchao: a missing one is one line now, not a traceback at model build."""
    recipe = spec.float8.recipe
    if str(recipe) != "none" and importlib.util.find_spec("torchao") is None:
        raise ConfigError(f"float8={recipe} needs torchao, which is not installed; "
                          "pip install torchao==0.18.0, or float8=none")


def _validate_fault_tolerance(spec: RunSpec) -> None:
    ft = spec.fault_tolerance
    if not ft.enabled:  # (its own value rules were spec_of's, when it built the group)
        return
    if spec.training.ema_decay > 0:
        raise ConfigError(f"training.ema_decay={spec.training.ema_decay} with fault_tolerance={ft.name}: a replica "
                          "group recovering from a live peer would not receive its EMA; set training.ema_decay=0")
    if ft.starts_alone and not ft.lighthouse:
        raise ConfigError(f"fault_tolerance.group={ft.group} starts that replica group on its own: it needs the "
                          "Lighthouse every group meets at, fault_tolerance.lighthouse=http://host:port "
                          "(start one with: torchft_lighthouse --min_replicas 1 --bind 0.0.0.0:29510)")
    if spec.cluster.launcher == "slurm" and not ft.starts_alone:
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


def _validate_data(data: DataSettings, vocab: int) -> None:
    """The data owners' own rules (``dataset.check_settings``, ``mixture.check_sources``), asked
    before any process starts, then the tokenizer against the model's vocabulary."""
    try:
        if data.mixture:
            check_sources(data.sources or {})
        elif data.source is not None:
            token_data.check_settings(data.source, data.path, data.seq_len, data.val_fraction, data.hf_name,
                                      data.streaming)
    except DataError as e:
        raise ConfigError(str(e)) from None
    _validate_tokenizer(str(data.tokenizer), vocab)


def _validate_tokenizer(tokenizer: str, vocab: int) -> None:
    if tokenizer != "builtin" and not Path(tokenizer).expanduser().exists():
        raise ConfigError(f"data.tokenizer={tokenizer} does not exist; give a tokenizer.json file or its directory")
    tok = Tokenizer(tokenizer)
    if tok.vocab_size > vocab:
        raise ConfigError(f"tokenizer vocab {tok.vocab_size} exceeds model.vocab_size={vocab}; "
                          "raise model.vocab_size or use a smaller tokenizer")


def _validate_eval(spec: RunSpec) -> None:
    """The settings against the family (``EvalSettings.check``), then the harness: lm-eval
    installed and every task known, before any model is built."""
    settings = spec.eval
    settings.check(spec.family)
    if settings.freq <= 0:
        return
    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError(f"eval.freq={settings.freq} needs the lm-eval harness: pip install -e '.[eval]' "
                          "(or set eval=none)")
    from titan_hydra.evaluation import check_tasks  # lm-eval: the optional eval extra, loaded only when asked for
    check_tasks(list(settings.tasks))


def _validate_ranges(spec: RunSpec) -> None:
    """Values of settings without a class of their own to refuse them, refused before anything is
    built: the pipeline's micro-batches, the data's document cap, the profiler's schedule."""
    check_positive("parallelism.pp_microbatches", spec.dims.pp_microbatches)
    check_positive("data.max_documents", spec.data.max_documents)
    profiling = spec.profiler.keywords
    if profiling.get("enable"):
        for key in ("profile_freq", "active"):
            check_positive(f"profiling.{key}", profiling.get(key))
        check_positive("profiling.warmup", profiling.get("warmup"), allow_zero=True)


def _validate_branch(spec: RunSpec, local_paths: bool) -> None:
    """``lr_scheduler=cooldown``: a full-state start from a stable run's checkpoint, before its end."""
    c = spec.checkpoint_settings
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
    check_branch_point(step, spec.training.steps, c.initial_load_path)


def _validate_checkpoint(spec: RunSpec, local_paths: bool) -> None:
    c = spec.checkpoint_settings
    check_positive("checkpoint.interval", c.interval, allow_zero=True)
    check_positive("checkpoint.keep_latest_k", c.keep_latest_k, allow_zero=True)
    unknown = sorted(set(c.exclude_from_loading or []) - set(CATEGORIES))
    if unknown:
        raise ConfigError(f"checkpoint.exclude_from_loading has unknown entries {unknown}; use {', '.join(CATEGORIES)}")
    if c.create_seed_checkpoint and spec.world_size != 1:
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
