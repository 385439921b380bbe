"""Fixtures shared by the test modules; the plain helpers they use live in helpers.py."""

from __future__ import annotations

import pytest

from helpers import RunCache, compose_cfg

# The SLURM modules share one local cluster (a session fixture) and spend most of their time
# waiting on it (a real time limit, requeue, accounting). Under ``-n 2 --dist loadgroup`` (the
# README's test command) they run as one group on one worker beside everything else, kept in its
# collected order on the other worker: the waiting overlaps the suite; only the SLURM group's
# short training runs share the cores with it. ``pytest`` without ``-n`` ignores the marks.
SLURM_MODULES = {"test_slurm.py", "test_slurm_requeue.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        group = "slurm" if item.path.name in SLURM_MODULES else "main"
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture
def compose_config():
    return compose_cfg


@pytest.fixture(scope="session")
def run_cache(tmp_path_factory) -> RunCache:
    """Reference runs that tests in several modules compare with, computed once per session."""
    return RunCache(tmp_path_factory)
