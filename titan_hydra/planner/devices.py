"""Device memory and peak throughput by GPU name, for the plan's fit check and step time.

A table of hardware facts, kept out of the sizing code. The peak comes from
titan_hydra/metrics/throughput.py's ``PEAK_TFLOPS`` (the same table a run's MFU uses), so a GPU's
peak is written down once.
"""

from __future__ import annotations


from titan_hydra.metrics.throughput import PEAK_TFLOPS
from titan_hydra.config import ClusterConfig

# Device memory (GiB) by GPU name in cluster.name / cluster.constraint.
DEVICE_MEMORY_GIB = {"h200": 141.0, "h100": 80.0, "a100": 80.0, "b200": 180.0, "l40s": 48.0}


def device_memory_of(c: ClusterConfig) -> float | None:
    """GiB of one device of the ``cluster`` node: ``gpu_mem_gib``, else by the GPU's name; None on CPU."""
    if c.device != "cuda":
        return None
    if c.gpu_mem_gib is not None:  # the cluster says (96 GB H100s)
        return float(c.gpu_mem_gib)
    text = f"{c.name} {c.constraint or ''}".lower()
    for key, gib in DEVICE_MEMORY_GIB.items():
        if key in text:
            return gib
    return None


def usable_memory_of(c: ClusterConfig) -> float | None:
    """GiB a rank's estimated peak may use: the device's memory less ``cluster.memory_headroom``
    (the estimator's measured error; config/schemas.py says how it was derived); None on CPU."""
    device = device_memory_of(c)
    return None if device is None else device * (1 - float(c.memory_headroom))


def peak_tflops_of(c: ClusterConfig) -> float | None:
    """Dense bf16 peak per device in TFLOP/s: ``cluster.peak_tflops`` if set, else on CUDA the
    ``PEAK_TFLOPS`` entry whose GPU name appears in cluster.name / cluster.constraint (longest name
    first, as metrics/throughput.py matches device names); None when unknown (CPU)."""
    if c.peak_tflops is not None:
        return float(c.peak_tflops)
    if c.device != "cuda":
        return None
    text = f"{c.name} {c.constraint or ''}".lower()
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key.lower() in text:
            return PEAK_TFLOPS[key]
    return None
