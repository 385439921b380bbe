"""The version of titan_hydra that is running: what checkpoints and prepared corpora record as the
code that wrote them, so that a later version can say which one did."""

from __future__ import annotations

from importlib import metadata


def project_version() -> str:
    """The installed titan_hydra's version (pyproject.toml), "unknown" when it is not installed."""
    try:
        return metadata.version("titan_hydra")
    except metadata.PackageNotFoundError:
        return "unknown"
