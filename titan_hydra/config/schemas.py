"""The schemas of what builds nothing: the root config, ``training`` and ``cluster``.

Every group whose option builds an object (``_target_``) has its schema derived from that object's
class in ``titan_hydra.groups``, which holds the one list of groups and registers every schema; the
root (``root_schema``, made from that list) types the groups ``Any`` (this layer is below the
classes), and each option file types its node by extending ``schema_<group>``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, make_dataclass
from typing import Any, Iterable, List, Optional

from omegaconf import MISSING, OmegaConf

from titan_hydra.config.choice import choice
from titan_hydra.config.mixture_draw import dirichlet_weight
from titan_hydra.config.run_dir import run_subdir

Precision = choice("Precision", "auto bf16 fp32", __name__)  # bf16 autocast / FSDP param dtype, plain fp32, or auto (hardware.py)
Device = choice("Device", "cpu cuda", __name__)
Backend = choice("Backend", "gloo nccl", __name__)
Launcher = choice("Launcher", "local slurm", __name__)
StartMethod = choice("StartMethod", "spawn fork forkserver", __name__)
AttentionPrecision = choice("AttentionPrecision", "auto compute fp32", __name__)
AttentionKernel = choice("AttentionKernel", "auto sdpa small_head scores", __name__)
GatedDeltaKernel = choice("GatedDeltaKernel", "auto torch fla", __name__)
InitMode = choice("InitMode", "auto full sharded", __name__)
BatchLrScaling = choice("BatchLrScaling", "auto none sqrt linear", __name__)


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
    # Fraction of that memory the planner keeps free (parallelism=auto's fit check and the plan's
    # "fits"): the estimator's largest underestimate of torchtitan's 18 published H100 peaks,
    # 1 - 0.836 (t6_fsdp1_cp8), rounded up to the percent. recipes/estimate_published.py prints it
    # and tests/test_estimator_published.py recomputes it from the rows. 0 = trust the estimate.
    memory_headroom: float = 0.17
    # Refuse a run whose planned peak cannot fit this machine (its RAM on CPU, the device on GPU), before
    # anything is built (planner/fit.py); false lets an expert go on anyway.
    memory_check: bool = True
    # SLURM (used by slurm clusters through hydra/launcher=titan_slurm; see launch/slurm.py)
    launcher: Launcher = Launcher["local"]
    tasks_per_node: Optional[int] = None  # SLURM tasks (= ranks) per node; slurm clusters tie nproc_per_node to it
    max_requeue: int = 3  # requeues after a time limit or a hang (submitit max_num_timeout; preemptions are free)
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
    # Gated DeltaNet layers (Qwen3.5): flash-linear-attention's kernels on CUDA when installed,
    # the plain torch forms elsewhere (titan_hydra.kernels.gated_delta_policy)
    gated_delta_kernel: GatedDeltaKernel = GatedDeltaKernel["auto"]
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
    # Schedules by tokens seen (titan_hydra/schedules.py): [[tokens_seen, value], ...], the first at 0,
    # both columns increasing. batch_schedule: the global batch in samples (more micro-batches per
    # step: global_batch_size stays -1); seq_len_schedule: the window length, ending at seq_len.
    batch_schedule: Optional[List[List[int]]] = None
    seq_len_schedule: Optional[List[List[int]]] = None
    # LR x f(B / first stage's B) under a batch schedule: auto = linear for SGD, sqrt otherwise
    batch_lr_scaling: BatchLrScaling = BatchLrScaling["auto"]
    # Decay of an exponential moving average of the weights (train/ema.py), validated as
    # val/ema/loss and checkpointed as ema.*; 0 = none (no memory, no work). 0.999: ~1000 steps.
    ema_decay: float = 0.0
    # dry_run=simulate: training steps simulated on fake tensors (the first creates the optimizer
    # state; the later ones show the steady-state peak)
    simulate_steps: int = 2


def root_schema(groups: Iterable[str], *, name: str, module: str) -> type:
    """The primary config's schema (``schema_titan``, which conf/config.yaml extends), bound as
    ``module.name`` so that a config pickles into spawned workers: a field per config group (``Any``
    here, typed by the chosen option's own ``schema_<group>``) and the settings of no group."""
    specs: list[tuple[str, Any, Any]] = [(group, Any, field(default=MISSING)) for group in groups]
    specs += [("training", TrainingConfig, field(default_factory=TrainingConfig)),
              ("dry_run", Any, field(default=False)),  # false | true | simulate (spec.dry_run_of)
              ("run_name", Optional[str], field(default=None)),
              ("tags", List[str], field(default_factory=list))]
    schema = make_dataclass(name, specs)
    schema.__module__ = module
    schema.__doc__ = "The primary config: one node per config group, the training settings, the run's name and tags."
    setattr(sys.modules[module], name, schema)
    return schema


def cooldown_start(steps: int, fraction: float) -> int:
    """``${th_cooldown_start:budget,fraction}``: the step a cooldown of ``fraction`` of a ``budget``-step
    run branches at (experiment=anneal_branches names each budget's checkpoint of the base run with it)."""
    return int(steps) - round(float(steps) * float(fraction))


def register_resolvers() -> None:
    """The run-dir resolver of ``hydra.run.dir: outputs/${th_run_subdir:}``, the branch point of an
    anneal sweep and the mixture search's ``${th_dirichlet:draw,alpha}`` (idempotent)."""
    if not OmegaConf.has_resolver("th_run_subdir"):
        OmegaConf.register_new_resolver("th_run_subdir", run_subdir)
    if not OmegaConf.has_resolver("th_cooldown_start"):
        OmegaConf.register_new_resolver("th_cooldown_start", cooldown_start)
    if not OmegaConf.has_resolver("th_dirichlet"):
        OmegaConf.register_new_resolver("th_dirichlet", dirichlet_weight)
