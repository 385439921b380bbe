"""The spine: the composed config is read once, by ``spec_of`` (and ``validate``), and every
group is built once per process; everything after validation reads the typed ``RunSpec``."""

from __future__ import annotations

import ast
import collections.abc
import dataclasses
import pickle
import typing
from collections import Counter
from pathlib import Path

import hydra.utils
from omegaconf import OmegaConf

from helpers import REPO, TINY, compose_cfg
from titan_hydra.spec import RunSpec
from titan_hydra.train.pretrain import run
from titan_hydra.validate import validate

PACKAGE = REPO / "titan_hydra"

# What may read the composed config: its own layer, the schemas' registry, validation, the
# entry points that act on the config before validation (resolve, sweeps, SLURM submission and
# its pre-flight check, the data-preparation jobs).
CONFIG_READERS = {
    "config", "groups.py", "launch/entry.py", "launch/resolve.py", "launch/sweep.py",
    "launch/sweep_check.py", "launch/slurm.py", "launch/slurm_check.py", "launch/submitit_jobs.py",
    "launch/prepare_jobs.py", "launch/dry_run.py",
}
# In spec.py only spec_of and the helpers it reads the config through.
SPEC_OF = {"spec_of", "training_of", "cluster_of", "check_model_node", "dims_of", "flavor_of"}
# In validate.py only the entry that builds the spec and Hydra's run-dir callback (the rules read the spec).
VALIDATE_OF = {"validate", "check_run_dir", "on_run_start", "on_multirun_start"}


def _reads_config(relative: str) -> bool:
    return relative in CONFIG_READERS or relative.split("/")[0] in CONFIG_READERS


def _names(annotation: ast.AST | None) -> set[str]:
    """Every identifier an annotation mentions (``DictConfig``, ``omegaconf.DictConfig``, a string)."""
    if annotation is None:
        return set()
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval")
        except SyntaxError:
            return set()
    return {n.id for n in ast.walk(annotation) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(annotation) if isinstance(n, ast.Attribute)}


def raw_config_reads(source: str, allowed_functions: frozenset[str] = frozenset()) -> list[tuple[int, str]]:
    """(line, what) of each raw-config read in ``source``:

    * ``<x>.config`` where ``x`` is a name a function annotates ``RunSpec`` or a name containing
      ``spec`` (the RunSpec has no ``config``; this catches a reintroduced one);
    * a function parameter annotated ``DictConfig`` (a function that takes the composed config
      or a node of it), except in ``allowed_functions``.
    """
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        params = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
        specs = {a.arg for a in params if "RunSpec" in _names(a.annotation)}
        if fn.name not in allowed_functions:
            found += [(a.lineno, f"{fn.name}({a.arg}: DictConfig)") for a in params
                      if "DictConfig" in _names(a.annotation)]
        for node in ast.walk(fn):
            if (isinstance(node, ast.Attribute) and node.attr == "config" and isinstance(node.value, ast.Name)
                    and (node.value.id in specs or "spec" in node.value.id.lower())):
                found.append((node.lineno, f"{node.value.id}.config in {fn.name}"))
    return sorted(set(found))


def test_the_rule_catches_what_it_names():
    source = ("def a(spec: RunSpec):\n    return spec.config.training\n"
              "def b(cfg: 'DictConfig'):\n    pass\n"
              "def c(s: RunSpec, node: omegaconf.DictConfig):\n    return s.config\n"
              "def d(spec: RunSpec):\n    return spec.training.steps\n")
    assert [what for _, what in raw_config_reads(source)] == [
        "spec.config in a", "b(cfg: DictConfig)", "c(node: DictConfig)", "s.config in c"]
    assert raw_config_reads("def b(cfg: DictConfig):\n    pass\n", frozenset({"b"})) == []


def test_nothing_after_validation_reads_the_raw_config():
    """Every module of the package except the config readers (``CONFIG_READERS``: the config layer,
    groups.py and the entry points that act before validation), spec.py's ``spec_of`` with its
    helpers and validate.py's entry: no ``.config`` off a RunSpec, no parameter typed DictConfig."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if _reads_config(relative):
            continue
        allowed = frozenset({"spec.py": SPEC_OF, "validate.py": VALIDATE_OF}.get(relative, ()))
        found += [f"titan_hydra/{relative}:{line} {what}" for line, what in raw_config_reads(path.read_text(), allowed)]
    assert not found, "\n".join(found)


def test_the_spec_holds_no_config_tree():
    """RunSpec fields are typed settings, built objects, partials and plain values: no DictConfig,
    and the resolved config travels as a plain dict (logged, never read for settings)."""
    spec = validate(compose_cfg(TINY))
    for f in dataclasses.fields(RunSpec):
        assert f.name != "config"
        assert not OmegaConf.is_config(getattr(spec, f.name)), f.name
    assert type(spec.resolved) is dict
    again = pickle.loads(pickle.dumps(spec))  # into spawned workers, rebuilt from nothing
    assert again.family is spec.family and again.model_args == spec.model_args and again.dims == spec.dims


def test_every_spec_field_is_typed():
    """Each field names its settings class, built object or partial: none is ``Any`` or a raw
    mapping, except the resolved config, which is logged and never read for settings."""
    loose = []
    for name, hint in typing.get_type_hints(RunSpec).items():
        origin = typing.get_origin(hint) or hint
        if hint is typing.Any or origin in (dict, collections.abc.Mapping, typing.Mapping):
            loose.append(name)
    assert loose == ["resolved"], loose


def test_validation_leaves_the_config_as_composed():
    """muP's multipliers travel in the spec's model args, not written into ``cfg.model``."""
    cfg = compose_cfg(TINY + ["parametrization=mup", "parametrization.base_width=32"])
    before = OmegaConf.to_container(cfg, resolve=True)
    spec = validate(cfg)
    assert OmegaConf.to_container(cfg, resolve=True) == before
    assert spec.model_args.logit_mult != 1.0 and spec.model_node["logit_mult"] == spec.model_args.logit_mult


def _targets(node) -> list[str]:
    """Every ``_target_`` in a plain config tree."""
    if isinstance(node, dict):
        own = [str(node["_target_"])] if "_target_" in node else []
        return own + [t for v in node.values() for t in _targets(v)]
    if isinstance(node, list):
        return [t for v in node for t in _targets(v)]
    return []


def test_each_group_is_built_once_per_run(tmp_path: Path, monkeypatch):
    """A default run in one process (validate, which calls spec_of, then the rank's program):
    every object the config names by ``_target_`` is instantiated exactly once. The optimizer's
    class is built over the parameters by ``train/optimizers.py`` (not through instantiate)."""
    built: Counter[str] = Counter()
    instantiate = hydra.utils.instantiate

    def counting(node, *args, **kwargs):
        plain = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
        built[str(plain.get("_target_"))] += 1
        return instantiate(node, *args, **kwargs)

    monkeypatch.setattr(hydra.utils, "instantiate", counting)  # what instantiate_checked and the logger call
    cfg = compose_cfg(TINY + ["training.steps=2", "training.val_freq=2", "cluster.threads_per_proc=1"])
    expected = set(_targets(OmegaConf.to_container(cfg, resolve=True))) - {str(cfg.optimizer._target_)}
    run(validate(cfg), str(tmp_path / "run"))
    assert set(built) == expected, set(built) ^ expected
    assert {t: n for t, n in built.items() if n != 1} == {}
