"""This rank's process: where it is in the world, its device, its seed, its process group."""

from __future__ import annotations

import os
import random

import numpy as np
import torch
import torch.distributed as dist

from titan_hydra.config import ClusterConfig
from titan_hydra.runtime.device import check_backend, check_device
from titan_hydra.runtime.rendezvous import init_process_group  # bounded, one-line failure


def world_info() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from the torch.distributed environment variables."""
    return (
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("LOCAL_RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
    )


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    # Set both ways: the mode is process-wide, and a run in the same process after a deterministic
    # one (tests, Hydra's in-process multirun) must not inherit it (it also changes which kernels
    # compile and run: see compile.check_settings).
    torch.use_deterministic_algorithms(bool(deterministic))
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def setup_device(cluster: ClusterConfig, local_rank: int) -> torch.device:
    check_device(str(cluster.device))
    if cluster.device == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(cluster: ClusterConfig, world_size: int) -> None:
    if world_size > 1 and not dist.is_initialized():
        check_backend(str(cluster.device), str(cluster.backend))
        init_process_group(str(cluster.backend), float(cluster.init_timeout_s))


def close_distributed() -> None:
    """Every rank past its last collective before any closes its gloo connections: a peer torn
    down mid-exchange made a rank abort at exit ("terminate called without an active exception")."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def abandon_distributed() -> None:
    """After a failure: no barrier, a failed rank's peers may never get there."""
    if dist.is_initialized():
        dist.destroy_process_group()
