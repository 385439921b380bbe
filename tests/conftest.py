"""Fixtures shared by the test modules; the plain helpers they use live in helpers.py."""

from __future__ import annotations

import pytest

from helpers import RunCache, compose_cfg


@pytest.fixture
def compose_config():
    return compose_cfg


@pytest.fixture(scope="session")
def run_cache(tmp_path_factory) -> RunCache:
    """Reference runs that tests in several modules compare with, computed once per session."""
    return RunCache(tmp_path_factory)
