"""Fixtures shared by the test modules; the plain helpers they use live in helpers.py."""

from __future__ import annotations

import os

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


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name not in SLURM_MODULES)  # stable: SLURM first, rest in order


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
