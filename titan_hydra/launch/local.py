"""Local multi-process launcher: torch elastic workers on this machine.

``python launch.py cluster.nproc_per_node=4`` lands here. The parent has already composed and
validated the config and chosen the run dir; it prepares the dataset cache once (so bad records
fail here, with one line, and workers don't all tokenize at once), then starts the workers
through torch elastic's launcher API with a c10d rendezvous on a free local port. Elastic
restarts (``cluster.max_restarts``) re-run the workers with the same config and run dir, which
is what lets a restarted run find its checkpoint.
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any

from omegaconf import DictConfig
from torch.distributed.elastic.multiprocessing.errors import record

from titan_hydra.errors import UserError


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@record
def worker_main(cfg: DictConfig, run_dir: str) -> dict[str, Any]:
    """Entry point of one elastic worker (module level so that spawn can pickle it)."""
    os.environ["TITAN_HYDRA_WORKER"] = "1"
    from titan_hydra.train.pretrain import run

    return run(cfg, run_dir)


def threads_per_worker(cfg: DictConfig) -> int:
    if cfg.cluster.threads_per_proc:
        return int(cfg.cluster.threads_per_proc)
    return max(1, (os.cpu_count() or 1) // int(cfg.cluster.nproc_per_node))


def run_local(cfg: DictConfig, run_dir: str) -> dict[str, Any]:
    """Run all ranks of this node; returns rank 0's summary."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from titan_hydra.train.pretrain import build_dataset

    if int(cfg.cluster.nnodes) != 1:
        raise UserError(
            f"cluster.nnodes={cfg.cluster.nnodes} needs a multi-node launcher; use a slurm cluster "
            "or start each node with torchrun"
        )
    build_dataset(cfg)  # fills the token cache; bad data fails here, before any worker starts
    nproc = int(cfg.cluster.nproc_per_node)
    port = cfg.cluster.master_port or free_port()
    os.environ["OMP_NUM_THREADS"] = str(threads_per_worker(cfg))
    launch_config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"titan-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{port}",
        rdzv_configs={"timeout": 120},
        max_restarts=int(cfg.cluster.max_restarts),
        monitor_interval=0.2,
        start_method="spawn",
    )
    try:
        results = elastic_launch(launch_config, worker_main)(cfg, run_dir)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        message = failure.message
        if isinstance(message, dict):
            message = message.get("message", str(message))
        first = str(message).strip().splitlines()[-1] if message else f"exit code {failure.exitcode}"
        raise RuntimeError(f"rank {rank} failed: {first} (see {failure.error_file} for its traceback)") from None
    return results[0]
