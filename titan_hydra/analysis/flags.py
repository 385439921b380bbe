"""The command-line flags several recipes share, declared once so they read the same everywhere.

A recipe builds its parser with ``parser(__doc__)`` and adds the shared flags it takes; what a
flag means in that recipe (where ``--out`` writes) is the ``help`` it passes.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def parser(doc: str, full: bool = False) -> argparse.ArgumentParser:
    """A recipe's parser: its docstring's first paragraph as the description (``full``: all of it,
    as written, for a recipe whose usage lines are its help)."""
    if full:
        return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    return argparse.ArgumentParser(description=doc.split("\n\n")[0])


def add_out(p: argparse.ArgumentParser, help: str, default: str | None = None, path: bool = False) -> None:
    """``--out``: where the recipe writes its result (``path``: parsed as a Path)."""
    p.add_argument("--out", type=Path if path else str, default=default, help=help)


def add_sweep_dirs(p: argparse.ArgumentParser, what: str = "multirun dir(s)") -> None:
    """The multirun dirs (``hydra.sweep.dir``) a report or fit reads, one or more."""
    p.add_argument("sweep_dirs", nargs="+", type=Path, help=f"{what} (hydra.sweep.dir)")


def add_bootstrap(p: argparse.ArgumentParser) -> None:
    """``--resamples`` and ``--level`` of a fit's bootstrap intervals."""
    p.add_argument("--resamples", type=int, default=200, help="bootstrap resamples")
    p.add_argument("--level", type=float, default=0.95, help="confidence level of the intervals")


def add_threads(p: argparse.ArgumentParser, default: int = 1) -> None:
    """``--threads``: torch threads per process of a benchmark."""
    p.add_argument("--threads", type=int, default=default, help="torch threads per process")
