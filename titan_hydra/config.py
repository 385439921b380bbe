"""Structured config schema, registered in Hydra's ConfigStore.

Every config group has a dataclass here (model schemas live with their family, e.g.
``titan_hydra/models/llama3/config.py``). The YAML options under ``conf/<group>/`` extend the
group's schema (``defaults: [/schema_<group>@_here_, _self_]``) and the primary config extends
``schema_titan``, so a misspelled key (``training.stepz=5``) or a wrong type
(``training.steps=abc``) fails while Hydra composes, before any process starts.

Objects the recipe builds carry a ``_target_`` (model, parallelism, optimizer, LR schedule,
float8 converter, dataset, logger backends) and are created with ``hydra.utils.instantiate``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from titan_hydra.hardware import Resolved, resolve_precision
from titan_hydra.models.registry import register_schemas


class Choice(str, Enum):
    """A string choice that the schema checks while Hydra composes (``compile.mode=modle`` fails
    there, listing the valid values) and that behaves as its plain string everywhere else:
    equal to it, hashed like it, printed as it (f-strings, ``repr`` in error messages, logs)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    def __repr__(self) -> str:
        return repr(str(self.value))


def choice(name: str, values: str) -> type:
    """A Choice enum whose member names are the values (``async`` and ``1F1B`` are valid too)."""
    return Choice(name, [(v, v) for v in values.split()])  # type: ignore[return-value]


Precision = choice("Precision", "auto bf16 fp32")  # bf16 autocast / FSDP param dtype, plain fp32, or auto (hardware.py)
ReshardPolicy = choice("ReshardPolicy", "default always never")
RotateMethod = choice("RotateMethod", "allgather alltoall")
PPSchedule = choice("PPSchedule", "GPipe 1F1B Interleaved1F1B LoopedBFS InterleavedZeroBubble ZBVZeroBubble DualPipeV")
DecayType = choice("DecayType", "linear cosine sqrt none")
Float8Recipe = choice("Float8Recipe", "none tensorwise rowwise")
Device = choice("Device", "cpu cuda")
Backend = choice("Backend", "gloo nccl")
Launcher = choice("Launcher", "local slurm")
StartMethod = choice("StartMethod", "spawn fork forkserver")
DataSource = choice("DataSource", "builtin json parquet text hf prepared")
ImageSource = choice("ImageSource", "shapes folder jsonl")
AsyncMode = choice("AsyncMode", "disabled async")
ExportDtype = choice("ExportDtype", "float32 bfloat16 float16")
ACMode = choice("ACMode", "none full selective_op selective_layer")
SACPolicy = choice("SACPolicy", "all_mm every_second_mm")
CompileMode = choice("CompileMode", "none model model_loss")
WandbMode = choice("WandbMode", "offline online disabled")
AttentionPrecision = choice("AttentionPrecision", "auto compute fp32")
AttentionKernel = choice("AttentionKernel", "auto sdpa small_head scores")
InitMode = choice("InitMode", "auto full sharded")


@dataclass
class ParallelismConfig:
    """Degrees of every parallel dimension; world size = dp_replicate*dp_shard*cp*tp*pp
    (``ep`` adds no ranks: it must divide dp_shard*cp).

    ``dp_shard=-1`` takes whatever the other degrees leave of the world size.
    """

    _target_: str = "titan_hydra.parallel.dims.ParallelDims"
    name: str = "single"
    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    # FSDP / DDP
    fsdp_reshard_after_forward: ReshardPolicy = ReshardPolicy["default"]
    fsdp_cpu_offload: bool = False
    # tensor parallel
    tp_sequence_parallel: bool = True
    tp_loss_parallel: bool = True
    tp_async: bool = False
    # pipeline parallel
    pp_schedule: PPSchedule = PPSchedule["1F1B"]
    pp_microbatches: Optional[int] = None
    pp_layers_per_stage: Optional[int] = None
    pp_split_points: List[str] = field(default_factory=list)
    # context parallel
    cp_rotate_method: RotateMethod = RotateMethod["allgather"]
    # expert parallel (MoE models): routed experts split over ep ranks borrowed from dp_shard x cp;
    # -1 = all of them
    ep: int = 1


@dataclass
class OptimizerConfig:
    """A torch optimizer for the model's parameters, with optional per-group settings or other
    optimizers (``param_groups``); built by ``titan_hydra.train.optimizers.build_optimizer``."""

    _target_: str = "torch.optim.AdamW"
    _partial_: bool = True
    lr: float = 8e-4
    betas: Optional[List[float]] = field(default_factory=lambda: [0.9, 0.95])
    eps: Optional[float] = 1e-8
    weight_decay: float = 0.1
    momentum: Optional[float] = None  # SGD's (null settings are not passed to the optimizer)
    foreach: Optional[bool] = None
    # null: fused where the optimizer class has a fused kernel for the parameters' device (AdamW,
    # Adam, SGD, Adagrad on CPU and CUDA), as torchtitan does; torch's own CPU default is a loop
    fused: Optional[bool] = None
    # per-group settings / other optimizers by parameter name and shape (train/optimizers.py):
    # [{name, match: [fnmatch FQN patterns], ndim, _target_?, <settings>}]
    param_groups: List[Any] = field(default_factory=list)


@dataclass
class LRSchedulerConfig:
    """Warmup -> stable -> decay, as a partial called with (optimizer, total steps)."""

    _target_: str = "titan_hydra.train.lr_schedule.build_lr_scheduler"
    _partial_: bool = True
    name: str = "warmup_cosine"
    warmup_steps: Optional[int] = None  # None: warmup_fraction of training.steps (any run length works)
    warmup_fraction: float = 0.2
    decay_ratio: Optional[float] = None  # fraction of steps spent decaying; None = all after warmup
    decay_type: DecayType = DecayType["cosine"]
    min_lr_factor: float = 0.0


@dataclass
class Float8Config:
    """torchao Float8 training (``recipe: none`` leaves the model untouched)."""

    _target_: str = "titan_hydra.quant.float8.Float8Converter"
    recipe: Float8Recipe = Float8Recipe["none"]
    enable_fsdp_float8_all_gather: bool = False
    precompute_float8_dynamic_scale_for_fsdp: bool = False
    filter_fqns: List[str] = field(default_factory=lambda: ["output"])
    auto_filter_small_kn: bool = True
    emulate: bool = False


@dataclass
class ClusterConfig:
    """Where and how ranks run: device, backend, processes, launcher settings."""

    name: str = "local_cpu"
    device: Device = Device["cpu"]
    backend: Backend = Backend["gloo"]
    nnodes: int = 1
    nproc_per_node: int = 1
    threads_per_proc: Optional[int] = None
    max_restarts: int = 0
    master_port: Optional[int] = None
    # How the local launcher starts its workers. spawn (torch elastic's default): each worker
    # imports torch and the program again (~3-5 s of CPU per rank before its first step).
    # forkserver: one server process imports them once and forks every worker (half spawn's CPU
    # for 2 ranks). fork: workers are copies of the launcher, which has imported everything
    # already (fastest), but it forks a process that has threads; CPU only. The default comes
    # from the environment variable TITAN_HYDRA_START_METHOD when set (the tests use forkserver).
    start_method: StartMethod = "${oc.env:TITAN_HYDRA_START_METHOD,spawn}"  # type: ignore[assignment]
    # Longest a rank waits for its peers at startup (rendezvous + process group connections);
    # past it the rank fails with one line naming the address it could not reach (runtime/rendezvous.py).
    init_timeout_s: int = 300
    peak_tflops: Optional[float] = None  # per-device peak for MFU; None = table or measured
    # Memory of one device in GiB for the estimator's fit check (planner/devices.py);
    # None = looked up from the GPU name in cluster.name / cluster.constraint.
    gpu_mem_gib: Optional[float] = None
    # SLURM (used by slurm clusters through hydra/launcher=titan_slurm; see launch/slurm.py)
    launcher: Launcher = Launcher["local"]
    tasks_per_node: Optional[int] = None  # SLURM tasks (= ranks) per node; slurm clusters tie nproc_per_node to it
    max_requeue: int = 3  # requeues after timeout/preemption (submitit max_num_timeout)
    signal_delay_s: int = 120  # SLURM signals this long before the time limit
    partition: Optional[str] = None
    gpus_per_node: int = 0
    cpus_per_task: Optional[int] = None
    mem_gb: Optional[int] = None
    timeout_min: int = 60
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    setup: List[str] = field(default_factory=list)


@dataclass
class DataConfig:
    """Dataset + tokenizer; ``source`` picks builtin / json / parquet / text / hf / prepared (shards
    written once by recipes/prepare_data.py)."""

    _target_: str = "titan_hydra.data.dataset.TokenDataset"
    name: str = "builtin"
    source: DataSource = DataSource["builtin"]
    path: Optional[str] = None
    tokenizer: str = "builtin"
    seq_len: int = "${training.seq_len}"  # type: ignore[assignment]
    text_field: str = "text"
    val_path: Optional[str] = None
    val_fraction: float = 0.05
    shuffle: bool = True
    seed: int = "${training.seed}"  # type: ignore[assignment]
    hf_name: Optional[str] = None
    hf_config: Optional[str] = None
    streaming: bool = False
    max_documents: Optional[int] = None
    cache_dir: Optional[str] = None
    document_mask: bool = False  # attention stays inside each packed document; positions restart per document


@dataclass
class ImageCaptionDataConfig:
    """Image-caption data (``data=flux_shapes``, ``flux_images``): ``source`` picks the procedural
    shapes set, a folder of images with .txt captions, or a JSONL of {"image", "text"};
    ``examples`` is the model family's example builder (it encodes and makes the batches)."""

    _target_: str = "titan_hydra.data.image_caption.ImageCaptionDataset"
    name: str = "shapes"
    source: ImageSource = ImageSource["shapes"]
    path: Optional[str] = None
    num_images: int = 256  # the shapes set's size; a cap on folder / JSONL data
    image_size: int = 64  # pixels per side (a multiple of 16)
    val_fraction: float = 0.125
    shuffle: bool = True
    seed: int = "${training.seed}"  # type: ignore[assignment]
    cache_dir: Optional[str] = None
    examples: Any = MISSING


@dataclass
class MixtureDataConfig:
    """Prepared corpora mixed by weight (``data=mixture``): ``sources`` maps a name to
    ``{path: <dir from recipes/prepare_data.py>, weight: <w>}``; weights need not sum to 1."""

    _target_: str = "titan_hydra.data.mixture.MixtureDataset"
    name: str = "mixture"
    sources: Dict[str, Any] = field(default_factory=dict)
    tokenizer: str = "builtin"
    seq_len: int = "${training.seq_len}"  # type: ignore[assignment]
    shuffle: bool = True
    seed: int = "${training.seed}"  # type: ignore[assignment]
    document_mask: bool = False
    cache_dir: Optional[str] = None


@dataclass
class CheckpointConfig:
    """Distributed checkpointing (DCP); the recipe completes the partial with what it built."""

    _target_: str = "titan_hydra.checkpoint.CheckpointManager"
    _partial_: bool = True
    enable: bool = False
    folder: str = "checkpoint"
    interval: int = 500  # save every N steps; 0 = only at the end of the run (and on preemption)
    keep_latest_k: int = 3  # newest complete checkpoints kept; 0 = keep all
    async_mode: AsyncMode = AsyncMode["disabled"]
    load_step: int = -1
    initial_load_path: Optional[str] = None
    initial_load_model_only: bool = True
    exclude_from_loading: List[str] = field(default_factory=list)
    last_save_model_only: bool = False
    export_dtype: ExportDtype = ExportDtype["float32"]
    create_seed_checkpoint: bool = False  # one process: save the initialized model as step-0, train nothing


@dataclass
class ActivationCheckpointConfig:
    _target_: str = "titan_hydra.parallel.ac.ActivationCheckpointing"
    mode: ACMode = ACMode["none"]
    selective_layer_freq: int = 2
    selective_op_policy: SACPolicy = SACPolicy["all_mm"]  # which matmul outputs selective_op saves


@dataclass
class CompileConfig:
    _target_: str = "titan_hydra.parallel.compile.Compiler"
    mode: CompileMode = CompileMode["none"]
    backend: str = "inductor"


@dataclass
class FaultToleranceConfig:
    """``fault_tolerance``: torchft replica groups (``runtime/fault_tolerance.py``)."""

    _target_: str = "titan_hydra.runtime.fault_tolerance.FaultTolerance"
    name: str = "none"
    replica_groups: int = 1  # replica groups the local launcher starts (each cluster.nproc_per_node ranks)
    min_replicas: int = 1  # a step commits only with at least this many groups in the quorum
    lighthouse: Optional[str] = None  # http://host:port of a running Lighthouse; None: launcher starts one
    timeout_s: float = 60.0  # collectives and checkpoint transfer between groups
    quorum_timeout_s: float = 60.0  # how long a step waits for its quorum
    join_timeout_ms: int = 1000  # Lighthouse: how long a forming quorum waits for more groups
    max_restarts: int = 3  # local launcher: restarts of a group that died, per group
    # this run is replica group <group> alone (started on its own: another machine, a SLURM job),
    # meeting the others at fault_tolerance.lighthouse; None: launch.py starts every group here
    group: Optional[int] = None
    # null: every step averages gradients over the groups; local_sgd / diloco: each group steps on
    # its own and the groups meet every sync_every steps (weights averaged / DiLoCo outer step)
    semi_sync: Optional[str] = None
    sync_every: int = 20
    outer_lr: float = 0.7  # DiLoCo's outer optimizer: SGD with Nesterov momentum (the paper's values)
    outer_momentum: float = 0.9
    outer_nesterov: bool = True


@dataclass
class ConsoleBackendConfig:
    _target_: str = "titan_hydra.metrics.backends.ConsoleBackend"


@dataclass
class JsonlBackendConfig:
    _target_: str = "titan_hydra.metrics.backends.JsonlBackend"
    filename: str = "metrics.jsonl"


@dataclass
class TensorBoardBackendConfig:
    _target_: str = "titan_hydra.metrics.backends.TensorBoardBackend"
    subdir: str = "tb"


@dataclass
class WandbBackendConfig:
    _target_: str = "titan_hydra.metrics.backends.WandbBackend"
    project: str = "titan_hydra"
    entity: Optional[str] = None
    group: Optional[str] = None
    name: Optional[str] = None
    tags: List[str] = field(default_factory=list)
    mode: WandbMode = WandbMode["offline"]
    notes: Optional[str] = None


@dataclass
class LoggerConfig:
    """Metric sinks; set one to null (``logger.wandb=null``) to turn it off."""

    console: Optional[ConsoleBackendConfig] = field(default_factory=ConsoleBackendConfig)
    jsonl: Optional[JsonlBackendConfig] = field(default_factory=JsonlBackendConfig)
    tensorboard: Optional[TensorBoardBackendConfig] = field(default_factory=TensorBoardBackendConfig)
    wandb: Optional[WandbBackendConfig] = field(default_factory=WandbBackendConfig)


@dataclass
class EvalConfig:
    """lm-eval harness tasks run on a full copy of the model every ``freq`` steps (0 = never);
    sample pictures drawn by it every ``sample_every`` steps (families that draw them: Flux)."""

    _target_: str = "titan_hydra.train.periodic_eval.PeriodicEval"
    freq: int = 0
    tasks: List[str] = field(default_factory=list)  # builtin_ppl, jsonl_mc:<file>, harness names
    limit: Optional[int] = None  # documents per task
    batch_size: int = 8
    max_seq_len: Optional[int] = "${training.seq_len}"  # type: ignore[assignment]  # scoring window
    sample_every: int = 0  # steps between sample pictures (and at the end); 0 = none
    sample_prompts: List[str] = field(default_factory=list)  # one picture each, in one row
    sample_steps: int = 20  # sampler steps per picture
    sample_guidance: float = 3.0  # guidance scale (classifier-free, or the embedded one of flux_dev)
    sample_seed: int = 0  # the pictures' noise: the same at every step, so rows compare across steps


@dataclass
class ProfilingConfig:
    """torch.profiler traces / memory snapshots; a partial completed by the recipe."""

    _target_: str = "titan_hydra.profiling.build_profiler"
    _partial_: bool = True
    enable: bool = False
    traces_folder: str = "profile_traces"
    profile_freq: int = 10
    warmup: int = 3
    active: int = 1
    enable_memory_snapshot: bool = False
    memory_snapshot_folder: str = "memory_snapshot"


@dataclass
class TrainingConfig:
    steps: int = 50
    local_batch_size: int = 8
    global_batch_size: int = -1  # -1 = local_batch_size * data-parallel degree (no accumulation)
    seq_len: int = 256
    max_norm: float = 1.0
    seed: int = 42
    # auto: bf16 where the device multiplies bf16 natively (CUDA Ampere+, CPUs with AVX512-BF16 /
    # AMX / Arm BF16), fp32 elsewhere (titan_hydra.hardware); bf16 / fp32 force one.
    mixed_precision: Precision = Precision["auto"]
    # dtype of scaled-dot-product attention under bf16: compute (bf16), fp32 (q/k/v upcast), or
    # auto = fp32 on CPU for head_dim < 32, where torch's CPU flash kernel runs fp32 faster than
    # bf16 (titan_hydra.kernels.attention_precision), compute everywhere else.
    attention_precision: AttentionPrecision = AttentionPrecision["auto"]
    attention_kernel: AttentionKernel = AttentionKernel["auto"]
    deterministic: bool = False
    log_freq: int = 1
    val_freq: int = 25  # 0 disables validation
    val_steps: int = 4
    val_local_batch_size: Optional[int] = None
    # How initial weights are made. full: rank 0 initializes the whole model from the seed and
    # broadcasts it into every layout's shards, so all layouts start from identical weights
    # (loss parity). sharded: each rank initializes its own shards (no full copy in memory;
    # weights then depend on the layout). auto: full below 1.5B parameters.
    init_mode: InitMode = InitMode["auto"]


@dataclass
class TitanConfig:
    # Typed by the chosen option's family schema (schema_model_<family>), or free-form for a
    # model defined outside titan_hydra (README: bring your own model).
    model: Any = MISSING
    parallelism: ParallelismConfig = MISSING
    optimizer: OptimizerConfig = MISSING
    lr_scheduler: LRSchedulerConfig = MISSING
    float8: Float8Config = MISSING
    cluster: ClusterConfig = MISSING
    # Typed by the chosen option's schema: token data (schema_data), a mixture of prepared
    # corpora (schema_data_mixture) or image-caption data (schema_data_image_caption).
    data: Any = MISSING
    checkpoint: CheckpointConfig = MISSING
    activation_checkpoint: ActivationCheckpointConfig = MISSING
    compile: CompileConfig = MISSING
    logger: LoggerConfig = MISSING
    profiling: ProfilingConfig = MISSING
    eval: EvalConfig = MISSING
    fault_tolerance: FaultToleranceConfig = MISSING
    training: TrainingConfig = field(default_factory=TrainingConfig)
    dry_run: bool = False
    run_name: Optional[str] = None
    tags: List[str] = field(default_factory=list)


GROUP_SCHEMAS = {
    "parallelism": ParallelismConfig,
    "optimizer": OptimizerConfig,
    "lr_scheduler": LRSchedulerConfig,
    "float8": Float8Config,
    "cluster": ClusterConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "activation_checkpoint": ActivationCheckpointConfig,
    "compile": CompileConfig,
    "logger": LoggerConfig,
    "profiling": ProfilingConfig,
    "eval": EvalConfig,
    "fault_tolerance": FaultToleranceConfig,
}

_RUN_STAMP: Optional[str] = None


def run_subdir() -> str:
    """A run directory name that every rank of one run computes identically.

    Under torchrun each rank composes its own config, so a timestamp would split ranks into
    different directories. torchrun's rendezvous id (random per ``--standalone`` run, or the
    user's ``--rdzv-id``) and SLURM's job id are shared by all ranks and survive a requeue.
    """
    global _RUN_STAMP
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and os.environ.get("TITAN_HYDRA_WORKER") is None:
        return f"torchrun/{run_id}"
    job = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    if job and os.environ.get("SUBMITIT_FOLDER") is None and os.environ.get("SLURM_STEP_ID"):
        task = os.environ.get("SLURM_ARRAY_TASK_ID")
        return f"slurm/{job}" + (f"_{task}" if task else "")
    if _RUN_STAMP is None:
        _RUN_STAMP = time.strftime("%Y-%m-%d/%H-%M-%S")
    return _RUN_STAMP


def register_configs() -> None:
    """Register the schemas and resolvers with Hydra (idempotent)."""
    if not OmegaConf.has_resolver("th_run_subdir"):
        OmegaConf.register_new_resolver("th_run_subdir", run_subdir)
    cs = ConfigStore.instance()
    # Stored outside the groups (``schema_<group>``), so that ``--help`` lists only real options;
    # each option file extends its schema with ``defaults: [/schema_<group>@_here_, _self_]``.
    cs.store(name="schema_titan", node=TitanConfig)
    for group, schema in GROUP_SCHEMAS.items():
        cs.store(name=f"schema_{group}", node=schema)
    cs.store(name="schema_data_image_caption", node=ImageCaptionDataConfig)
    cs.store(name="schema_data_mixture", node=MixtureDataConfig)
    register_schemas(cs)


register_configs()

# The config tree launch.py runs with (``@hydra.main(config_path="conf")`` beside it).
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def compose_config(overrides: Iterable[str] = (), config_dir: Path = CONF_DIR):
    """The config ``launch.py OVERRIDES`` would run with, composed without a Hydra run (no run
    dir, no launch, nothing validated yet): the one way recipes and tests build a config."""
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def mixed_precision_of(cfg: Any) -> str:
    """``training.mixed_precision`` as the plain "bf16" / "fp32" it means on ``cluster.device``."""
    return precision_choice_of(cfg).value


def precision_choice_of(cfg: Any) -> Resolved:
    """``training.mixed_precision`` resolved for ``cluster.device``, with the reason (``auto``)."""
    device = plain(OmegaConf.select(cfg, "cluster.device", default="cpu"))
    return resolve_precision(plain(cfg.training.mixed_precision), device)


def plain(value: Any) -> Any:
    """A Choice as its plain string (for libraries that check ``type(x) is str``); else unchanged."""
    return str(value.value) if isinstance(value, Enum) else value


def to_container(cfg: Any) -> dict:
    """Resolved plain-dict view of a config (for loggers and W&B)."""
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)  # type: ignore[return-value]
