"""Imports of third-party modules that talk while they load, with nothing a user can act on.

torchao (which diffusers imports for its quantizers, and the float8 group imports itself) logs
"Failed to load .../_C_cutlass_90a.so / _C_mxfp8.so" (CUDA kernels for SM90 and MX formats,
absent from a CPU install), and torch's pytree logs a deprecation note about torchao registering
an Enum as a pytree constant. ``import_quietly`` raises those loggers to ERROR for the import
only: real errors still come through, and later messages of the same loggers are untouched.

``ignoring`` does the same for one call's Python warnings, by their text: DCP warns that it
"assumes the intent is to load (save) in a single process" on every load or save without a process
group, which is exactly what a recipe (convert, generate, eval) or a one-process run means to do.
``loggers_at_error`` quiets a library's info log for one call (lm-eval announcing each request
type under a run's INFO logging). ``without_progress_bars`` turns off tqdm's bars (lm-eval building its requests, HF datasets
generating a split) for a recipe whose own lines say what it did.

This module sits at the bottom of the package (it imports only the standard library).
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

IMPORT_NOISE = ("torchao", "torch.utils._pytree")
# torch.distributed.checkpoint.load / save without an initialized process group (torch 2.13 warns
# even when the caller passes no_dist=True).
DCP_SINGLE_PROCESS = "torch.distributed is disabled, unavailable or uninitialized"


def import_quietly(name: str, noisy: tuple[str, ...] = IMPORT_NOISE) -> ModuleType:
    """``importlib.import_module(name)`` with the ``noisy`` loggers at ERROR meanwhile."""
    with loggers_at_error(*noisy):
        return importlib.import_module(name)


@contextmanager
def loggers_at_error(*names: str) -> Iterator[None]:
    """The ``names`` loggers (and their children) at ERROR meanwhile, their levels restored after."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


@contextmanager
def ignoring(*messages: str) -> Iterator[None]:
    """Python warnings whose text starts with one of ``messages`` are dropped meanwhile; every
    other warning still shows."""
    with warnings.catch_warnings():
        for message in messages:
            warnings.filterwarnings("ignore", message=re.escape(message))
        yield


def without_progress_bars() -> None:
    """tqdm bars off in this process unless ``TQDM_DISABLE`` is already set. tqdm reads the
    variable when it is first imported: an entry point calls this before importing the library."""
    os.environ.setdefault("TQDM_DISABLE", "1")
