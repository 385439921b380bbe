"""Fixtures shared by the test modules; the plain helpers they use live in helpers.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

from helpers import RunCache, compose_cfg

# Under ``-n 3`` (the README's test command: three workers on CI's two cores, because the SLURM
# tests and process start-ups leave a core idle much of the time) the workers take whole modules, so a
# module-scoped fixture (a trained checkpoint, a set of launched runs) is built on one worker
# only. The SLURM modules share one local cluster (a session fixture) and spend most of their
# time waiting on it (a real time limit, requeue, accounting): they form one unit, scheduled
# first, so that their waiting overlaps the rest of the suite and no two SLURM tests ever
# compete for the one-node cluster. (xdist's own ``loadgroup`` marks do not group with
# pytest 9.2, whose node ids no longer follow the ``_nodeid`` attribute xdist 3.8 rewrites;
# the scheduler below groups by module itself.)
SLURM_MODULES = {"test_slurm.py", "test_slurm_requeue.py"}

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
    """Whole modules per worker, the SLURM modules as one unit (see above)."""
    return ModuleScheduling(config, log)


class ModuleScheduling(LoadScopeScheduling):
    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        return "slurm" if Path(module).name in SLURM_MODULES else module


@pytest.fixture
def compose_config():
    return compose_cfg


@pytest.fixture(scope="session")
def run_cache(tmp_path_factory) -> RunCache:
    """Reference runs that tests in several modules compare with, computed once per session."""
    return RunCache(tmp_path_factory)
