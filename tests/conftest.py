"""Fixtures shared by the test modules; the plain helpers they use live in helpers.py."""

from __future__ import annotations

import pytest

from helpers import RunCache, compose_cfg

# Under ``-n 2 --dist loadgroup`` (the README's test command) the two workers take whole modules
# (an xdist group per module, so a module-scoped fixture, e.g. a trained checkpoint, is built on
# one worker only). The SLURM modules share one local cluster (a session fixture) and spend most
# of their time waiting on it (a real time limit, requeue, accounting), so they form one group
# that is scheduled first: its waiting overlaps the rest of the suite on both workers.
# ``pytest`` without ``-n`` ignores the marks.
SLURM_MODULES = {"test_slurm.py", "test_slurm_requeue.py"}


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name not in SLURM_MODULES)  # stable: SLURM first, rest in order
    for item in items:
        group = "slurm" if item.path.name in SLURM_MODULES else item.path.stem
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture
def compose_config():
    return compose_cfg


@pytest.fixture(scope="session")
def run_cache(tmp_path_factory) -> RunCache:
    """Reference runs that tests in several modules compare with, computed once per session."""
    return RunCache(tmp_path_factory)
