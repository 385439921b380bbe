"""Errors that mean "the user's input is wrong" (config, data, checkpoint, environment).

launch.py prints them as one line ``error: ...`` and exits non-zero; anything else is a bug
and keeps its traceback.

``check_writable_dir`` lives here, beside ``ConfigError``, because both the config checks
(validate.py) and the checkpoint package (which may not import validate.py) need it.
"""

from __future__ import annotations

import inspect
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable


class UserError(ValueError):
    """Bad input with a message that says what is wrong and how to fix it."""


class ConfigError(UserError):
    """The composed config breaks a cross-field rule."""


class DataError(UserError):
    """A data file, the tokenizer or the token cache cannot serve this run (empty, binary,
    too short for one sample, unreadable, unwritable cache)."""


class CheckpointError(UserError):
    """A checkpoint (a DCP step dir or an HF directory) that cannot be loaded: says which one and
    what is wrong. Here, at the bottom, because both models (reading HF directories) and the
    checkpoint package raise it."""


class RankFailed(UserError):
    """A rank died without a Python error (a signal: kill -9, the OOM killer). Not bad input, but
    nothing the user can read in a traceback either: the launcher reports the rank and the signal."""


def first_line(error: BaseException) -> str:
    """The first non-empty line of an exception's message, or its type name when it has none."""
    for line in str(error).splitlines():
        if line.strip():
            return line.strip()
    return type(error).__name__


def exit_status(work: Callable[[], str]) -> int:
    """A command-line recipe's exit status: 0 after printing the line ``work`` returns (what it
    wrote), 2 after printing a UserError as one line ``error: ...`` on stderr, as launch.py does
    (the message says what to fix; a traceback would bury it). Anything else keeps its traceback."""
    try:
        done = work()
    except UserError as e:
        print(f"error: {first_line(e)}", file=sys.stderr)
        return 2
    print(done)
    return 0


def check_writable_dir(path: str | os.PathLike, what: str) -> None:
    """Create ``path`` if needed and prove a file can be written there; ConfigError if not.

    Root ignores permission bits, so "writable" is tested by writing, not by os.access.
    """
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise ConfigError(f"{what}={path} is not a writable directory ({reason}); point it elsewhere") from None


class TrainingDiverged(RuntimeError):
    """The loss became NaN/inf; raised on every rank so the run stops cleanly."""


# The key that names a group's chosen option (``data.name: c4``, ``parallelism.name: fsdp``): the run
# header, the planner and the logs read it from the config; an object receives it only when it takes
# a ``name`` parameter because it acts on the choice (``fault_tolerance``, ``parametrization``).
LABEL = "name"


def without_label(node: dict) -> dict:
    """``node`` less its option label ``name``, unless its ``_target_`` takes a ``name`` parameter."""
    from hydra.utils import get_object  # hydra only where a config is instantiated (this layer is imported by all)

    target = node.get("_target_")
    if LABEL not in node or not isinstance(target, str):
        return node
    try:
        takes = LABEL in inspect.signature(get_object(target)).parameters
    except (ImportError, AttributeError, ValueError, TypeError):  # a bad target: instantiate says so
        return node
    return node if takes else {k: v for k, v in node.items() if k != LABEL}


def instantiate_checked(node, **kwargs):
    """``hydra.utils.instantiate`` that surfaces bad-input errors as UserError; the node's option
    label is dropped first (``without_label``): every group instantiates through here.

    Hydra wraps whatever a constructor raises in InstantiationException with a multi-line
    message; for input errors (a ValueError from a dataset, ConfigError from ParallelDims)
    the user should see the constructor's own one-line message instead.
    """
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate
    from omegaconf import DictConfig, OmegaConf

    if isinstance(node, DictConfig):
        # Choice enums (config.Choice) arrive as their plain strings: constructors and the
        # libraries behind them compare and store ordinary str values.
        node = OmegaConf.to_container(node, resolve=True, enum_to_str=True)
    if isinstance(node, dict):
        node = without_label(node)
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as e:
        cause = e.__cause__
        if isinstance(cause, UserError):
            raise cause
        if isinstance(cause, (ValueError, FileNotFoundError)):
            raise UserError(first_line(cause)) from cause
        raise
