"""Choice: a string setting whose valid values the schema checks while Hydra composes.

The values are the owner's own constants (``groups.py``), so they are written once. The owner
still checks them in its constructor: tests, recipes and the planner build it without the schema.
A rule that only ever sees a composed config (``validate``'s) does not check them again."""

from __future__ import annotations

from enum import Enum
from typing import Iterable


class Choice(str, Enum):
    """A string choice that the schema checks while Hydra composes (``compile.mode=modle`` fails
    there, listing the valid values) and that behaves as its plain string everywhere else:
    equal to it, hashed like it, printed as it (f-strings, ``repr`` in error messages, logs)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    def __repr__(self) -> str:
        return repr(str(self.value))


def choice(name: str, values: str | Iterable[str], module: str) -> type:
    """A Choice enum ``module.name`` whose member names are the values (``async`` and ``1F1B`` are
    valid too). ``values``: a space-separated string, or the owner's tuple of valid values.
    ``module`` is where the caller binds it, so that configs holding it pickle into spawned workers."""
    values = values.split() if isinstance(values, str) else list(values)
    return Choice(name, [(v, v) for v in values], module=module)  # type: ignore[return-value]
