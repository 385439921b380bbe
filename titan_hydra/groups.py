"""The config groups (``GROUPS``, the one list) and their schemas, derived from what they build.

The class (or builder function) an option's ``_target_`` names owns every default: the group's
schema is derived from its fields or keyword parameters (``titan_hydra.config.derive``), so the
two cannot drift, and an option file under ``conf/<group>/`` states only what differs from it.
A model family's schema is derived the same way, from its args class (``schema_model_<family>``).
The string settings the schema checks while composing are Choice enums made from the owner's own
constants (``parallelism.pp_schedule`` from ``PP_SCHEDULES``). The optimizer's schema is written
in ``config/optimizer.py`` (its target is any torch class; see ``OptimizerConfig``).

This module sits in a layer above every class it reads; it registers all schemas in Hydra's
ConfigStore on import (``launch.py`` imports it) and ``compose_config`` composes with them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore

from titan_hydra import errors
from titan_hydra.checkpoint.manager import ASYNC_MODES, EXPORT_DTYPES, CheckpointSettings
from titan_hydra.config import ClusterConfig, choice, register_resolvers, root_schema, schema_from
from titan_hydra.config.eval import EvalSettings
from titan_hydra.config.optimizer import OptimizerConfig
from titan_hydra.config.derive import with_open_maps
from titan_hydra.data import dataset as token_data
from titan_hydra.data import image_caption
from titan_hydra.data.mixture import MixtureDataset
from titan_hydra.logger.backends import WANDB_MODES, ConsoleBackend, JsonlBackend, TensorBoardBackend, WandbBackend
from titan_hydra.models.parametrization import KINDS as PARAMETRIZATIONS, Parametrization
from titan_hydra.models.registry import BUILTIN, get_family
from titan_hydra.parallel import activation_checkpoint, compile as compiling
from titan_hydra.parallel.parallelism import CP_ROTATE_METHODS, PP_SCHEDULES, RESHARD_POLICIES, ParallelDims
from titan_hydra.profiling import build_profiler
from titan_hydra.float8 import Float8Converter
from titan_hydra.runtime.fault_tolerance import FaultTolerance
from titan_hydra.schedules import DECAY_TYPES, CooldownSchedule, WarmupDecay
from titan_hydra.config.fault_injection import FaultInjection
from titan_hydra.config.health import CHECKSUM_ACTIONS, SPIKE_ACTIONS, Health

ReshardPolicy = choice("ReshardPolicy", RESHARD_POLICIES, __name__)
RotateMethod = choice("RotateMethod", CP_ROTATE_METHODS, __name__)
PPSchedule = choice("PPSchedule", PP_SCHEDULES, __name__)
DecayType = choice("DecayType", DECAY_TYPES, __name__)
Float8Recipe = choice("Float8Recipe", Float8Converter.RECIPES, __name__)
DataSource = choice("DataSource", token_data.SOURCES, __name__)
ImageSource = choice("ImageSource", image_caption.SOURCES, __name__)
AsyncMode = choice("AsyncMode", ASYNC_MODES, __name__)
ExportDtype = choice("ExportDtype", EXPORT_DTYPES, __name__)
ACMode = choice("ACMode", activation_checkpoint.MODES, __name__)
SACPolicy = choice("SACPolicy", activation_checkpoint.SAC_POLICIES, __name__)
CompileMode = choice("CompileMode", compiling.MODES, __name__)
WandbMode = choice("WandbMode", WANDB_MODES, __name__)
SpikeAction = choice("SpikeAction", SPIKE_ACTIONS, __name__)
ChecksumAction = choice("ChecksumAction", CHECKSUM_ACTIONS, __name__)
ParametrizationName = choice("ParametrizationName", PARAMETRIZATIONS, __name__)

# Settings that follow another key rather than the owner's default (which serves direct callers).
SEQ_LEN, SEED = "${training.seq_len}", "${training.seed}"
# The chosen option's label (``name``: the run header, the planner, logs); no object receives it
# (errors.instantiate_checked drops it). A model node's labels are its family and flavor.
LABEL = {errors.LABEL: (str, "custom")}

ParallelismConfig = schema_from(
    ParallelDims, name="ParallelismConfig", module=__name__, labels=LABEL,
    given=("world_size", "replica_groups", "replica_group"),  # the recipe's: the launch and fault_tolerance
    choices={"fsdp_reshard_after_forward": ReshardPolicy, "pp_schedule": PPSchedule, "cp_rotate_method": RotateMethod})
LRSchedulerConfig = schema_from(WarmupDecay, name="LRSchedulerConfig", module=__name__, labels=LABEL,
                                choices={"decay_type": DecayType})
CooldownConfig = schema_from(CooldownSchedule, name="CooldownConfig", module=__name__, labels=LABEL,
                             choices={"decay_type": DecayType})
Float8Config = schema_from(Float8Converter, name="Float8Config", module=__name__, choices={"recipe": Float8Recipe})
DataConfig = schema_from(token_data.TokenDataset, name="DataConfig", module=__name__, labels=LABEL,
                         choices={"source": DataSource}, links={"seq_len": SEQ_LEN, "seed": SEED})
ImageCaptionDataConfig = schema_from(image_caption.ImageCaptionDataset, name="ImageCaptionDataConfig",
                                     module=__name__, labels=LABEL, choices={"source": ImageSource},
                                     links={"seed": SEED})
MixtureDataConfig = schema_from(MixtureDataset, name="MixtureDataConfig", module=__name__, labels=LABEL,
                                links={"seq_len": SEQ_LEN, "seed": SEED})
CheckpointConfig = schema_from(CheckpointSettings, target="titan_hydra.checkpoint.CheckpointManager",
                               name="CheckpointConfig", module=__name__,
                               partial=True, choices={"async_mode": AsyncMode, "export_dtype": ExportDtype})
ActivationCheckpointConfig = schema_from(activation_checkpoint.ActivationCheckpointing, name="ActivationCheckpointConfig", module=__name__,
                                         choices={"mode": ACMode, "selective_op_policy": SACPolicy})
CompileConfig = schema_from(compiling.Compiler, name="CompileConfig", module=__name__, choices={"mode": CompileMode})
ParametrizationConfig = schema_from(Parametrization, name="ParametrizationConfig", module=__name__,
                                    choices={"name": ParametrizationName})
FaultToleranceConfig = schema_from(FaultTolerance, name="FaultToleranceConfig", module=__name__)
HealthConfig = schema_from(Health, name="HealthConfig", module=__name__,
                           choices={"spike_action": SpikeAction, "checksum_action": ChecksumAction})
FaultInjectionConfig = schema_from(FaultInjection, name="FaultInjectionConfig", module=__name__)
EvalConfig = schema_from(EvalSettings, name="EvalConfig", module=__name__, links={"max_seq_len": SEQ_LEN})
ProfilingConfig = schema_from(build_profiler, name="ProfilingConfig", module=__name__, partial=True,
                              given=("run_dir", "rank", "model_parts", "optimizer", "device"))
# metrics backends: MetricLogger passes the run dir (and the run's config to W&B)
ConsoleBackendConfig = schema_from(ConsoleBackend, name="ConsoleBackendConfig", module=__name__, given=("run_dir",))
JsonlBackendConfig = schema_from(JsonlBackend, name="JsonlBackendConfig", module=__name__, given=("run_dir",))
TensorBoardBackendConfig = schema_from(TensorBoardBackend, name="TensorBoardBackendConfig", module=__name__,
                                       given=("run_dir",))
WandbBackendConfig = schema_from(WandbBackend, name="WandbBackendConfig", module=__name__,
                                 given=("run_dir", "config"), choices={"mode": WandbMode})


@dataclass
class LoggerConfig:
    """Metric sinks; set one to null (``logger.wandb=null``) to turn it off."""

    # (the backend schemas are made at run time: ``valid-type`` silences type checkers, not Hydra)
    console: Optional[ConsoleBackendConfig] = field(default_factory=ConsoleBackendConfig)  # type: ignore[valid-type]
    jsonl: Optional[JsonlBackendConfig] = field(default_factory=JsonlBackendConfig)  # type: ignore[valid-type]
    tensorboard: Optional[TensorBoardBackendConfig] = field(  # type: ignore[valid-type]
        default_factory=TensorBoardBackendConfig)
    wandb: Optional[WandbBackendConfig] = field(default_factory=WandbBackendConfig)  # type: ignore[valid-type]




def model_schema(family_name: str) -> type:
    """``schema_model_<family>``: the family's args fields (shape fields MISSING: each flavor's yaml
    sets them), ``_target_`` its model class, and the node's labels ``family`` / ``flavor``."""
    family = get_family(family_name)
    return schema_from(family.args_cls, target=family.model_cls, name=f"Model_{family_name}", module=__name__,
                       labels={"family": (str, family_name), "flavor": (str, "custom")})


# The groups of the primary config, in conf/config.yaml's defaults order, each with the schemas its
# option files extend ({suffix: schema} stored as ``schema_<group><suffix>``): the one list of groups.
# The root schema is made from it, and conf/config.yaml's defaults list (Hydra's file, which also picks
# each group's default option) names the same groups in the same order (tests/test_groups.py).
GROUPS: dict[str, dict[str, type]] = {
    "model": {f"_{name}": model_schema(name) for name in BUILTIN},
    "parallelism": {"": ParallelismConfig},
    "optimizer": {"": OptimizerConfig},
    "parametrization": {"": ParametrizationConfig},
    "lr_scheduler": {"": LRSchedulerConfig, "_cooldown": CooldownConfig},
    "float8": {"": Float8Config},
    "cluster": {"": ClusterConfig},
    "data": {"": DataConfig, "_image_caption": ImageCaptionDataConfig, "_mixture": MixtureDataConfig},
    "checkpoint": {"": CheckpointConfig},
    "activation_checkpoint": {"": ActivationCheckpointConfig},
    "compile": {"": CompileConfig},
    "logger": {"": LoggerConfig},
    "profiling": {"": ProfilingConfig},
    "eval": {"": EvalConfig},
    "fault_tolerance": {"": FaultToleranceConfig},
    "health": {"": HealthConfig},
    "fault_injection": {"": FaultInjectionConfig},
}
# Groups whose options write at the root (``# @package _global_``): no node, no schema; last in the
# defaults list, so that a recipe overrides every group above.
ROOT_GROUPS = ("experiment",)
# ``schema_<name>``: what each option file extends (``defaults: [/schema_<name>@_here_, _self_]``)
SCHEMAS = {group + suffix: schema for group, table in GROUPS.items() for suffix, schema in table.items()}
TitanConfig = root_schema(GROUPS, name="TitanConfig", module=__name__)


def register_configs() -> None:
    """Register every schema and the resolvers with Hydra (idempotent)."""
    register_resolvers()
    cs = ConfigStore.instance()
    # Stored outside the groups (``schema_<name>``), so that ``--help`` lists only real options.
    cs.store(name="schema_titan", node=TitanConfig)
    for name, schema in SCHEMAS.items():
        cs.store(name=f"schema_{name}", node=with_open_maps(schema))


register_configs()

# The config tree launch.py runs with (``@hydra.main(config_path="conf")`` beside it).
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def compose_config(overrides: Iterable[str] = (), config_dir: Path = CONF_DIR):
    """The config ``launch.py OVERRIDES`` would run with, composed without a Hydra run (no run
    dir, no launch, nothing validated yet): the one way recipes and tests build a config."""
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))
