"""Imports of third-party modules that talk while they load, with nothing a user can act on.

torchao (which diffusers imports for its quantizers, and the float8 group imports itself) logs
"Failed to load .../_C_cutlass_90a.so / _C_mxfp8.so" (CUDA kernels for SM90 and MX formats,
absent from a CPU install), and torch's pytree logs a deprecation note about torchao registering
an Enum as a pytree constant. ``import_quietly`` raises those loggers to ERROR for the import
only: real errors still come through, and later messages of the same loggers are untouched.

This module sits at the bottom of the package (it imports only the standard library).
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

IMPORT_NOISE = ("torchao", "torch.utils._pytree")


def import_quietly(name: str, noisy: tuple[str, ...] = IMPORT_NOISE) -> ModuleType:
    """``importlib.import_module(name)`` with the ``noisy`` loggers at ERROR meanwhile."""
    loggers = [logging.getLogger(n) for n in noisy]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        return importlib.import_module(name)
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
