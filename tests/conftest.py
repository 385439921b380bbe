"""Fixtures shared by the test modules; the plain helpers they use live in helpers.py."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from statistics import median

import pytest
from helpers import RunCache, compose_cfg
from xdist_scheduling import SLURM_MODULES, ModuleScheduling

# Launched runs start their workers from a fork server that imported torch and titan_hydra once:
# half the CPU of spawn (torch elastic's default and ours, which imports everything in every
# rank), which is what a 2-core machine running two test workers is short of. Not fork: the
# launcher has threads by then (torch elastic's rendezvous store) and a 4-rank run once hung at
# start under it. test_launch_local checks that spawn, fork, forkserver and torchrun agree; the
# fault tests launch with spawn (they find workers by its command line).
os.environ.setdefault("TITAN_HYDRA_START_METHOD", "forkserver")


MODULE_DURATIONS = Path(__file__).with_name("module_durations.json")


def pytest_addoption(parser):
    parser.addoption("--store-module-durations", action="store_true",
                     help=f"write the seconds each module ran to {MODULE_DURATIONS.name} (the order "
                          "workers take modules in; modules not run keep their entry)")


def apply_tiers(config, items) -> None:
    """The tiers (docs/testing.md#tiers): ``@pytest.mark.gate("id", ...)`` on a parametrized test
    keeps the named parametrizations in CI's gate (``-m "not extended"``) and marks the others
    ``extended``. A named id that no longer exists fails the collection (a renamed parameter must
    not drop a test from the gate unseen)."""
    seen: dict[object, set[str]] = defaultdict(set)
    for item in items:
        if item.get_closest_marker("gate") is not None and hasattr(item, "callspec"):
            seen[item.function].add(item.callspec.id)
    explicit = any("[" in arg for arg in config.args)  # node ids name single parametrizations
    for item in items:
        gate = item.get_closest_marker("gate")
        if gate is None or not hasattr(item, "callspec"):
            continue
        stale = set(gate.args) - seen[item.function]
        if stale and not explicit:
            raise pytest.UsageError(f"{item.path.name}::{item.originalname}: gate ids {sorted(stale)} are not among "
                                    f"its parametrizations {sorted(seen[item.function])}; update @pytest.mark.gate")
        if item.callspec.id not in gate.args:
            item.add_marker(pytest.mark.extended)


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects: it reads the tier marks set here
def pytest_collection_modifyitems(config, items):
    """The tiers' marks (apply_tiers); then the SLURM unit first (it mostly waits), then the
    longest modules (a long one last is a tail).

    A module not in the file yet counts as a median one. The sort is stable: tests of a module
    keep their order.
    """
    apply_tiers(config, items)
    seconds = json.loads(MODULE_DURATIONS.read_text()) if MODULE_DURATIONS.exists() else {}
    usual = median(seconds.values()) if seconds else 0.0
    items.sort(key=lambda item: (item.path.name not in SLURM_MODULES,
                                 -seconds.get(item.path.name, usual)))


_module_seconds: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report):
    _module_seconds[Path(report.nodeid.split("::", 1)[0]).name] += report.duration


def pytest_sessionfinish(session, exitstatus):
    # the controller sees every worker's reports; a worker (workerinput set) writes nothing
    if session.config.getoption("store_module_durations") and not hasattr(session.config, "workerinput"):
        # a run of some modules updates those and keeps the others'
        known = json.loads(MODULE_DURATIONS.read_text()) if MODULE_DURATIONS.exists() else {}
        known.update((m, round(s, 1)) for m, s in _module_seconds.items())
        ordered = dict(sorted(known.items(), key=lambda kv: -kv[1]))
        MODULE_DURATIONS.write_text(json.dumps(ordered, indent=1) + "\n")


def pytest_xdist_make_scheduler(config, log):
    """Whole modules per worker, the SLURM modules first as one unit (xdist_scheduling.py)."""
    return ModuleScheduling(config, log)


@pytest.fixture
def compose_config():
    return compose_cfg


@pytest.fixture(scope="session")
def run_cache(tmp_path_factory) -> RunCache:
    """Reference runs that tests in several modules compare with, computed once per session."""
    return RunCache(tmp_path_factory)


@pytest.fixture
def float8_conversions(monkeypatch) -> list[str]:
    """The FQNs of the Linear layers float8 converts during the test (filled as runs convert)."""
    from titan_hydra.float8 import Float8Converter

    converted: list[str] = []
    real_convert = Float8Converter.convert

    def convert(self, model):
        out = real_convert(self, model)
        converted.extend(self.converted)
        return out

    monkeypatch.setattr(Float8Converter, "convert", convert)
    return converted
