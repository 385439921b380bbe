"""Device memory by GPU name, for the plan's fit check.

A table of hardware facts, kept out of the sizing code.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

# Device memory (GiB) by GPU name in cluster.name / cluster.constraint.
DEVICE_MEMORY_GIB = {"h200": 141.0, "h100": 80.0, "a100": 80.0, "b200": 180.0, "l40s": 48.0}


def device_memory_of(cfg: DictConfig) -> float | None:
    c = cfg.cluster
    if c.device != "cuda":
        return None
    if OmegaConf.select(cfg, "cluster.gpu_mem_gib") is not None:  # the cluster says (96 GB H100s)
        return float(c.gpu_mem_gib)
    text = f"{c.name} {OmegaConf.select(cfg, 'cluster.constraint') or ''}".lower()
    for key, gib in DEVICE_MEMORY_GIB.items():
        if key in text:
            return gib
    return None
