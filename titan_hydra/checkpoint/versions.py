"""Checkpoints that survive upgrades: the format version and the project version every checkpoint
records, and what a load does with a checkpoint of another format.

Every completion marker (``COMPLETE.json``) carries ``format`` (the layout of what a checkpoint
holds: its entries, their names and meaning) and ``titan_hydra`` (the version of the code that
wrote it). On load (``upgraded``):

* a newer format than this code knows is refused in one line naming both versions: the checkpoint
  was written by a later titan_hydra, whose meaning this code cannot know;
* an older format goes through ``MIGRATIONS`` one version at a time: a step whose meaning is
  unchanged rewrites the marker; a step whose meaning changed has no function and is refused in
  one line saying what changed;
* a marker without ``format`` was written before the field existed: format 0, whose content is
  format 1's.

When a change must break the format: raise ``FORMAT_VERSION`` by one and add ``MIGRATIONS[old]``
saying what changed; ``tests/test_checkpoint_compat.py`` keeps a checkpoint of every released
format and resumes it bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from titan_hydra.errors import CheckpointError
from titan_hydra.version import project_version

FORMAT_VERSION = 1


@dataclass(frozen=True)
class Migration:
    """From format ``MIGRATIONS`` key to the next one. ``changed``: what the next format changed,
    as the refusal line says it. ``marker``: the marker rewritten for the next format, None when the
    meaning changed and nothing can convert it (then the load is refused)."""

    changed: str
    marker: Optional[Callable[[dict[str, Any]], dict[str, Any]]] = None


def _same(marker: dict[str, Any]) -> dict[str, Any]:
    return {**marker, "format": 1}


# format -> how a checkpoint of that format becomes one of the next
MIGRATIONS: dict[int, Migration] = {
    0: Migration("format 1 added the format and project version to the marker; the content is the same", _same),
}


def upgraded(marker: dict[str, Any] | None, path: str | Path) -> dict[str, Any] | None:
    """The marker of the checkpoint at ``path`` in today's format; CheckpointError (one line) for a
    newer format, or an older one that cannot be converted."""
    if marker is None:
        return None
    fmt = int(marker.get("format", 0))
    wrote = marker.get("titan_hydra", "a titan_hydra from before versions were recorded")
    if fmt > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format {fmt} (written by titan_hydra {wrote}); this titan_hydra "
            f"{project_version()} reads formats up to {FORMAT_VERSION}: load it with titan_hydra {wrote} or newer")
    while fmt < FORMAT_VERSION:
        step = MIGRATIONS.get(fmt)
        if step is None or step.marker is None:
            what = step.changed if step else "no migration exists"
            raise CheckpointError(
                f"checkpoint {path} has format {fmt} (written by titan_hydra {wrote}) and this titan_hydra "
                f"{project_version()} reads format {FORMAT_VERSION}: {what}; it cannot be converted, load it with "
                f"titan_hydra {wrote}")
        marker = step.marker(marker)
        fmt += 1
    return marker
