"""A default is written once: in the class (or builder function) a group's ``_target_`` names.

Each group schema must carry exactly its target's settings with the target's defaults (read
here straight from the dataclass fields or the signature, not through the derivation), and no
option file under conf/ may restate a schema default; a config holding the derived schemas and
their Choice enums must pickle into a fresh process (spawned workers)."""

from __future__ import annotations

import dataclasses
import inspect
import pickle
import subprocess
import sys
from collections.abc import Mapping
from enum import Enum

import pytest
from hydra.core.config_store import ConfigStore
from hydra.utils import get_object
from omegaconf import MISSING, OmegaConf

from helpers import CONF, REPO, compose_cfg
from titan_hydra import groups
from titan_hydra.checkpoint.manager import CheckpointManager, CheckpointSettings
from titan_hydra.parallel.parallelism import PP_SCHEDULES

# Where a target takes its settings as **kwargs, the dataclass that lists them.
SETTINGS_OF = {CheckpointManager: CheckpointSettings}
# Hand-written on purpose: the optimizer's target is any torch class (train/optimizers.py);
# logger is a container of the backends' derived schemas (checked one by one below); cluster
# builds nothing (config/schemas.py). The model families' schemas: tests/test_groups.py.
NOT_DERIVED = {"optimizer", "logger", "cluster"}
DERIVED = {name: schema for name, schema in groups.SCHEMAS.items()
           if name not in NOT_DERIVED and not name.startswith("model_")}
DERIVED.update({f"logger.{f.name}": f.default_factory for f in dataclasses.fields(groups.LoggerConfig)})
LINKS = {"${training.seq_len}", "${training.seed}"}  # a setting that follows another key


def target_defaults(target) -> dict:
    """{setting: default (MISSING when it has none)} as the target itself writes them."""
    owner = SETTINGS_OF.get(target, target)
    if dataclasses.is_dataclass(owner):
        return {f.name: (f.default if f.default is not dataclasses.MISSING else
                         f.default_factory() if f.default_factory is not dataclasses.MISSING else MISSING)
                for f in dataclasses.fields(owner)}
    return {p.name: (MISSING if p.default is p.empty else p.default)
            for p in inspect.signature(owner).parameters.values() if p.kind is not p.VAR_KEYWORD}


def plain(value):
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Mapping):
        return dict(value)
    return list(value) if isinstance(value, tuple) else value


@pytest.mark.parametrize("group", sorted(DERIVED))
def test_schema_defaults_are_the_targets(group):
    node = OmegaConf.structured(DERIVED[group])
    schema = OmegaConf.to_container(node, enum_to_str=True)
    target = get_object(schema.pop("_target_"))
    schema.pop("_partial_", None)
    if group.startswith(("data", "parallelism", "lr_scheduler")):
        assert schema.pop("name") == "custom"  # the option's label: instantiate_checked drops it
    own = target_defaults(target)
    extra = set(schema) - set(own)
    assert not extra, f"{group}: schema keys {sorted(extra)} are not settings of {target.__name__}"
    for key, value in schema.items():
        expected = plain(own[key])
        if isinstance(value, str) and value in LINKS:
            continue
        if expected is MISSING:
            assert OmegaConf.is_missing(node, key), f"{group}.{key}: {value!r} but {target.__name__} has no default"
        else:
            assert value == expected, f"{group}.{key}: schema {value!r} != {target.__name__}'s {expected!r}"


def test_the_recipe_passes_what_the_schema_leaves_out():
    """A target setting missing from its schema is one the recipe passes when it builds the object."""
    left_out = {}
    for group, schema in DERIVED.items():
        keys = {f.name for f in dataclasses.fields(schema)}
        own = target_defaults(get_object(OmegaConf.structured(schema)._target_))
        left_out[group] = sorted(set(own) - keys)
    assert left_out["parallelism"] == ["replica_group", "replica_groups", "world_size"]
    assert left_out["profiling"] == ["device", "model_parts", "optimizer", "rank", "run_dir"]
    assert left_out["logger.wandb"] == ["config", "run_dir"]
    assert all(not v for g, v in left_out.items()
               if g not in ("parallelism", "profiling") and not g.startswith("logger."))


def test_choices_come_from_the_owner():
    assert [m.value for m in groups.PPSchedule] == list(PP_SCHEDULES)
    assert OmegaConf.structured(groups.ActivationCheckpointConfig).selective_op_policy == "all_mm"


def option_files():
    # not conf/model/: a flavor file spells out its published model's whole shape (test_config
    # compares it with the released Hugging Face config), defaults included
    for path in sorted(p for p in CONF.glob("*/*.yaml") if p.parent.name != "model"):
        raw = OmegaConf.load(path)
        schema = next((d.split("@")[0].lstrip("/") for d in raw.get("defaults", [])
                       if isinstance(d, str) and d.startswith("/schema_")), None)
        if schema is not None:
            yield path, raw, schema


def restated(raw, default, where: str) -> list[str]:
    found = []
    for key, value in raw.items():
        if key == "defaults" or key not in default:
            continue
        if isinstance(value, dict) and isinstance(default[key], dict):
            found += restated(value, default[key], f"{where}{key}.")
        elif value == default[key]:
            found.append(f"{where}{key}: {value!r}")
    return found


def test_no_option_file_restates_a_schema_default():
    """An option states only what differs from its schema; ``name`` equal to the file's own name
    is the option's label, not a default."""
    cs = ConfigStore.instance()
    found, files = [], 0
    for path, raw, schema in option_files():
        files += 1
        default = OmegaConf.to_container(cs.load(f"{schema}.yaml").node, enum_to_str=True)
        body = OmegaConf.to_container(raw)
        if body.get("name") == path.stem:
            body.pop("name")
        found += [f"{path.relative_to(REPO)}: {r}" for r in restated(body, default, "")]
    assert files >= 50
    assert not found, "\n".join(found)


def test_the_composed_default_run_keeps_its_values():
    cfg = compose_cfg()
    assert cfg.lr_scheduler.min_lr_factor == 0.1 and cfg.lr_scheduler.warmup_fraction == 0.2
    assert cfg.lr_scheduler.warmup_steps is None and cfg.lr_scheduler.decay_type == "cosine"
    assert list(cfg.float8.filter_fqns) == ["output"]
    assert cfg.optimizer.weight_decay == 0.1 and list(cfg.optimizer.betas) == [0.9, 0.95]
    assert cfg.data.seq_len == cfg.training.seq_len and cfg.eval.max_seq_len == cfg.training.seq_len
    assert cfg.parallelism.dp_shard == 1 and cfg.activation_checkpoint.selective_op_policy == "all_mm"


def test_a_composed_config_pickles_into_a_fresh_process():
    cfg = compose_cfg(["parallelism=fsdp_pp", "lr_scheduler=wsd", "checkpoint=async"])
    code = ("import pickle, sys; cfg = pickle.load(sys.stdin.buffer); "
            "print(cfg.parallelism.pp_schedule, cfg.lr_scheduler.decay_type, cfg.checkpoint.async_mode, "
            "type(cfg.parallelism.pp_schedule).__module__)")
    proc = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(cfg), capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert proc.stdout.decode().split() == ["1F1B", "sqrt", "async", "titan_hydra.groups"]
