"""``training.mixed_precision`` resolved for the device the run uses."""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from titan_hydra.config.plain import plain
from titan_hydra.config.schemas import ClusterConfig
from titan_hydra.hardware import Resolved, resolve_precision


def mixed_precision_of(cfg: Any) -> str:
    """``training.mixed_precision`` as the plain "bf16" / "fp32" it means on ``cluster.device``."""
    return precision_choice_of(cfg).value


def precision_choice_of(cfg: Any) -> Resolved:
    """``training.mixed_precision`` resolved for ``cluster.device``, with the reason (``auto``)."""
    # a config without a cluster node runs on ClusterConfig's default device
    device = plain(OmegaConf.select(cfg, "cluster.device", default=ClusterConfig.device))
    return resolve_precision(plain(cfg.training.mixed_precision), device)
