"""Errors that mean "the user's input is wrong" (config, data, checkpoint, environment).

launch.py prints them as one line ``error: ...`` and exits non-zero; anything else is a bug
and keeps its traceback.
"""


class UserError(ValueError):
    """Bad input with a message that says what is wrong and how to fix it."""


class ConfigError(UserError):
    """The composed config breaks a cross-field rule."""


class TrainingDiverged(RuntimeError):
    """The loss became NaN/inf; raised on every rank so the run stops cleanly."""


def instantiate_checked(node, **kwargs):
    """``hydra.utils.instantiate`` that surfaces bad-input errors as UserError.

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
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as e:
        cause = e.__cause__
        if isinstance(cause, UserError):
            raise cause
        if isinstance(cause, (ValueError, FileNotFoundError)):
            raise UserError(str(cause).splitlines()[0] if str(cause) else repr(cause)) from cause
        raise
