"""The ``cluster`` group's device rules, written once: ``validate`` asks them before any process
starts, and each rank asks again where it picks its device, because a rank may start on another
machine (a SLURM node) than the one that validated the config."""

from __future__ import annotations

import torch

from titan_hydra.errors import ConfigError


def check_device(device: str) -> None:
    """``cluster.device=cuda`` with no GPU visible fails here in one line, not in torch's first CUDA call."""
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("cluster.device=cuda but no CUDA device is visible; use cluster=local_cpu "
                          "(or run where a GPU is visible)")


def check_backend(device: str, backend: str) -> None:
    """NCCL talks between GPUs only: on CPU the process group would fail to start."""
    if device == "cpu" and backend != "gloo":
        raise ConfigError(f"cluster.backend={backend} needs CUDA; use cluster.backend=gloo on CPU")


def check_start_method(device: str, start_method: str) -> None:
    """A forked worker may inherit the launcher's CUDA state, which CUDA does not survive."""
    if device == "cuda" and start_method == "fork":
        raise ConfigError("cluster.start_method=fork is CPU only (a forked worker may inherit CUDA state); "
                          "use cluster.start_method=spawn or forkserver")
