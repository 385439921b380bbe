"""Resolve what the composed config leaves open, before validation: ``parallelism=auto``.

The one place a layout choice is written into the config: the planner picks it from the run's
spec (``planner/auto.py``), and the degrees land in ``cfg.parallelism`` with the name
``auto:<degrees>``, so the run's logged config records the choice and a second call (a SLURM
task re-entering ``launch``) is a no-op.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf, open_dict

from titan_hydra.planner.auto import Candidate, choose_layout
from titan_hydra.spec import spec_of


def resolve_auto(cfg: DictConfig) -> DictConfig:
    """Replace ``parallelism=auto`` by concrete degrees (in place); other layouts pass through."""
    if OmegaConf.select(cfg, "parallelism.name") != "auto":
        return cfg
    set_degrees(cfg, choose_layout(spec_of(cfg)))
    return cfg


def set_degrees(cfg: DictConfig, c: Candidate) -> None:
    with open_dict(cfg):
        for k, v in c.degrees().items():
            cfg.parallelism[k] = v
        cfg.parallelism.pp_microbatches = c.pp_microbatches
        cfg.parallelism.name = "auto:" + c.describe(",")
