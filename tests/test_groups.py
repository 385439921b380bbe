"""One derivation, one list of groups, one meaning of ``name``.

Every group schema and every model family's schema is made by ``config.derive.schema_from``
(a family's straight from its args and model classes, compared here field by field without the
derivation); a built-in family is named once in the package, in ``registry.BUILTIN``; the groups
are listed once, in ``groups.GROUPS``, which conf/config.yaml's defaults list must match; and
``name`` is an option's label that no constructor receives unless it acts on the choice."""

from __future__ import annotations

import ast
import collections
import importlib
import dataclasses
import inspect
import typing

import pytest
from hydra.core.config_store import ConfigStore
from hydra.utils import get_object
from omegaconf import MISSING, OmegaConf

from helpers import CONF, REPO
from titan_hydra import groups
from titan_hydra.checkpoint.manager import CheckpointManager, CheckpointSettings
from titan_hydra.errors import instantiate_checked
from titan_hydra.models.parametrization import Parametrization
from titan_hydra.models.registry import BUILTIN, get_family
from titan_hydra.parallel.parallelism import ParallelDims
from titan_hydra.schedules import WarmupDecay

PACKAGE = REPO / "titan_hydra"
HAND_WRITTEN = {"optimizer", "logger", "cluster"}  # see tests/test_defaults_once.py
SETTINGS_OF = {CheckpointManager: CheckpointSettings}  # a target whose settings live on a dataclass


def test_no_family_writes_a_schema_module():
    assert sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.glob("models/*/config.py")) == []
    assert not (PACKAGE / "models" / "common" / "schema.py").exists()
    makers = sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
                    if "make_dataclass(" in p.read_text())
    assert makers == ["config/derive.py", "config/schemas.py"]  # the derivation, the root schema


def family_names_in(path) -> list[tuple[str, int]]:
    """(family name, line) of every string literal equal to a built-in family name, outside the
    assignment of ``LEGACY_FAMILY`` (an old checkpoint's family, not a registration)."""
    tree = ast.parse(path.read_text())
    legacy = {id(n) for a in ast.walk(tree) if isinstance(a, ast.Assign)
              and any(getattr(t, "id", None) == "LEGACY_FAMILY" for t in a.targets) for n in ast.walk(a)}
    return [(n.value, n.lineno) for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and n.value in BUILTIN and id(n) not in legacy]


def test_each_builtin_family_is_named_once():
    """Outside its own package a family's name is written once: its entry in registry.BUILTIN."""
    own = tuple(PACKAGE / "models" / name for name in BUILTIN)
    found = collections.defaultdict(list)
    for path in PACKAGE.rglob("*.py"):
        # data/ names its sources, another namespace: its "hf" is HF datasets, not the hf family;
        # bench/ holds the benchmark suites (command lines, like recipes/): they name what they measure
        if not any(path.is_relative_to(p) for p in (*own, PACKAGE / "data", PACKAGE / "bench")):
            for name, line in family_names_in(path):
                found[name].append(f"{path.relative_to(REPO)}:{line}")
    assert {name: len(where) for name, where in found.items()} == {name: 1 for name in BUILTIN}, dict(found)
    assert all(where[0].startswith("titan_hydra/models/registry.py:") for where in found.values()), dict(found)
    for name in BUILTIN:
        family = get_family(name)
        assert family.name == name and family is importlib.import_module(f"titan_hydra.models.{name}").FAMILY


def expected_model_node(name: str) -> dict:
    """The node ``schema_model_<name>`` must be, read straight from the family's classes."""
    family = get_family(name)
    node = {"_target_": f"{family.model_cls.__module__}.{family.model_cls.__qualname__}", "family": name,
            "flavor": "custom"}
    hints = typing.get_type_hints(family.args_cls)
    for f in dataclasses.fields(family.args_cls):
        sub = [a for a in typing.get_args(hints[f.name]) or (hints[f.name],) if dataclasses.is_dataclass(a)]
        if sub:  # ``moe: MoEArgs | dict``: a sub-node with MoEArgs' fields
            node[f.name] = {g.name: default_of(g) for g in dataclasses.fields(sub[0])}
        else:
            node[f.name] = default_of(f)
    return node


def default_of(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "???"
    return list(value) if isinstance(value, tuple) else value


@pytest.mark.parametrize("name", BUILTIN)
def test_each_model_schema_is_its_family_derived(name):
    stored = ConfigStore.instance().load(f"schema_model_{name}.yaml").node
    schema = groups.SCHEMAS[f"model_{name}"]
    assert OmegaConf.get_type(stored) is schema and schema._derived_from is get_family(name).args_cls
    assert OmegaConf.to_container(stored, enum_to_str=True) == expected_model_node(name)
    assert get_object(stored._target_) is get_family(name).model_cls


def test_every_stored_schema_comes_from_the_one_derivation():
    cs = ConfigStore.instance()
    stored = sorted(n.removesuffix(".yaml") for n in cs.list("") if n.startswith("schema_"))
    assert stored == sorted(["schema_titan", *(f"schema_{name}" for name in groups.SCHEMAS)])
    for name, schema in groups.SCHEMAS.items():
        assert OmegaConf.get_type(cs.load(f"schema_{name}.yaml").node) is schema
        if name in HAND_WRITTEN or name.startswith("model_"):  # models: the test above
            continue
        target = get_object(OmegaConf.structured(schema)._target_)
        assert schema._derived_from is SETTINGS_OF.get(target, target), name


def defaults_groups() -> list[str]:
    raw = OmegaConf.to_container(OmegaConf.load(CONF / "config.yaml"))
    return [next(iter(d)) for d in raw["defaults"] if isinstance(d, dict)]


def test_the_group_list_is_written_once():
    """conf/config.yaml (Hydra's file) names groups.GROUPS in order; the root schema's group fields
    are made from it; every option folder under conf/ is one of them."""
    assert defaults_groups() == [*groups.GROUPS, *groups.ROOT_GROUPS]
    root = [f.name for f in dataclasses.fields(groups.TitanConfig)]
    assert root[:len(groups.GROUPS)] == list(groups.GROUPS) and set(root[len(groups.GROUPS):]).isdisjoint(
        [*groups.GROUPS, *groups.ROOT_GROUPS])
    folders = {p.name for p in CONF.iterdir() if p.is_dir()} - {"hydra"}
    assert folders == {*groups.GROUPS, *groups.ROOT_GROUPS}
    assert all(name.split("_")[0] in {g.split("_")[0] for g in groups.GROUPS} for name in groups.SCHEMAS)


def test_name_labels_the_option_and_reaches_no_constructor_that_ignores_it():
    assert "name" not in {f.name for f in dataclasses.fields(ParallelDims)}
    assert "name" not in inspect.signature(WarmupDecay).parameters
    for group in ("parallelism", "lr_scheduler", "data", "data_image_caption", "data_mixture"):
        assert OmegaConf.structured(groups.SCHEMAS[group]).name == "custom", group
    dims = instantiate_checked({"_target_": "titan_hydra.parallel.parallelism.ParallelDims", "name": "fsdp",
                                "world_size": 2, "dp_shard": 2})
    assert dims.dp_shard == 2 and not hasattr(dims, "name")
    # an object that acts on the chosen option takes it as a parameter
    assert instantiate_checked({"_target_": "titan_hydra.models.parametrization.Parametrization",
                                "name": "sp"}) == Parametrization(name="sp")
