"""Every ``_target_`` a user can set is checked against what its group builds, before anything runs
(titan_hydra/config/targets.py): a callable of the wrong kind is one line naming the group and what
it expects, never a traceback after the model is built; every option shipped in conf/ passes."""

from __future__ import annotations

import pytest

from helpers import CONF, compose_cfg
from titan_hydra.config.targets import check_targets, targets_of
from titan_hydra.errors import ConfigError
from titan_hydra.launch.entry import launch

GROUP_OPTIONS = sorted((group.name, option.stem) for group in CONF.iterdir() if group.is_dir()
                       and group.name not in ("hydra", "experiment") for option in group.glob("*.yaml"))
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


# Every published model flavor names the same family targets as its debug flavor: those run in
# the extended tier (docs/testing.md#tiers), every other option in the gate.
TIERED = [pytest.param(g, o, marks=pytest.mark.extended if g == "model" and "debug" not in o else ())
          for g, o in GROUP_OPTIONS]


@pytest.mark.parametrize("group,option", TIERED)
def test_every_option_in_conf_builds_what_its_group_builds(group, option):
    check_targets(compose_cfg([f"{group}={option}"]))


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_builds_what_its_groups_build(experiment):
    check_targets(compose_cfg([f"experiment={experiment}"]))


def test_a_wrong_kind_is_one_line_from_launch_before_anything_is_built(capsys, tmp_path, monkeypatch):
    import titan_hydra.spec as spec

    def never(*a, **k):  # nothing may be built: the check is spec_of's first step
        raise AssertionError("a group was built before the targets were checked")

    monkeypatch.setattr(spec, "cluster_of", never)
    with pytest.raises(SystemExit) as e:
        launch(compose_cfg(["lr_scheduler._target_=os.getcwd"]), str(tmp_path))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: lr_scheduler._target_=os.getcwd is not what the lr_scheduler group builds: it expects a "
                   "titan_hydra.schedules.WarmupDecay or titan_hydra.schedules.CooldownSchedule or "
                   "torch.optim.lr_scheduler.LRScheduler (that class, a subclass, or a function annotated to return one); "
                   "it is a function without a return annotation")


DEFAULT_TARGETS = {path: str(node._target_) for path, node in targets_of(compose_cfg([]))}


@pytest.mark.parametrize("path", sorted(DEFAULT_TARGETS))
def test_every_group_refuses_a_callable_of_another_kind(path):
    with pytest.raises(ConfigError) as e:
        check_targets(compose_cfg([f"{path}._target_=collections.OrderedDict"]))
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"{path}._target_=collections.OrderedDict is not what the "
                                                f"{path.split('.')[0]} group builds: it expects a ")
    assert line.endswith("it builds a collections.OrderedDict")


@pytest.mark.parametrize("override,message", [
    ("optimizer._target_=torch.nn.Linear", "it expects a torch.optim.optimizer.Optimizer (that class, a subclass, "
                                           "or a function annotated to return one); it builds a "
                                           "torch.nn.modules.linear.Linear"),
    ("model._target_=os.system", "it is a function without a return annotation"),  # (Hydra refuses it too)
    ("data._target_=no_such_module.Dataset", "data._target_=no_such_module.Dataset cannot be used: "),
])
def test_refusals_say_what_the_target_is(override, message):
    with pytest.raises(ConfigError) as e:
        check_targets(compose_cfg([override]))
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("override", [
    "optimizer._target_=torch.optim.SGD",  # any torch optimizer
    "optimizer._target_=titan_hydra.train.muon.Muon",  # the project's own, an Optimizer subclass
    "lr_scheduler._target_=torch.optim.lr_scheduler.ConstantLR",  # any LR schedule class
    "logger.console._target_=titan_hydra.logger.backends.JsonlBackend",  # any class with log()
])
def test_other_targets_of_the_right_kind_pass(override):
    check_targets(compose_cfg([override]))

