"""Plain values out of a composed config, for libraries and loggers that want str / dict."""

from __future__ import annotations

from enum import Enum
from typing import Any

from omegaconf import OmegaConf


def plain(value: Any) -> Any:
    """A Choice as its plain string (for libraries that check ``type(x) is str``); else unchanged."""
    return str(value.value) if isinstance(value, Enum) else value


def to_container(cfg: Any) -> dict:
    """Resolved plain-dict view of a config (for loggers and W&B)."""
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)  # type: ignore[return-value]


def run_settings(cfg: Any) -> dict:
    """Every setting of the run as plain values, without Hydra's own node: a sweep point composed
    ahead of its job holds one, with values only that job knows (``hydra.job.num``)."""
    keys = [k for k in cfg if k != "hydra"]
    return to_container(OmegaConf.masked_copy(cfg, keys) if len(keys) < len(cfg) else cfg)
