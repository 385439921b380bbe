"""Checks before anything is submitted to SLURM: sbatch on PATH, tasks vs processes, the partition.

Its own module because both the submitting launcher (``slurm.py``) and the sweep check that
runs before any job of a sweep starts (``sweep_check.py``) call it, and the launcher already
depends on the sweep check through the job collector.
"""

from __future__ import annotations

import shutil
import subprocess

from omegaconf import DictConfig

from titan_hydra.errors import UserError


def check_slurm(cfg: DictConfig) -> None:
    """One-line UserError when this machine cannot submit the job the cluster config asks for."""
    c = cfg.cluster
    if shutil.which("sbatch") is None:
        raise UserError(
            f"cluster={c.name} submits to SLURM but 'sbatch' is not on PATH; run on a SLURM login node "
            "(or start the local test cluster: scripts/slurm/start.sh) or use cluster=local_cpu"
        )
    if c.tasks_per_node is not None and int(c.tasks_per_node) != int(c.nproc_per_node):
        raise UserError(
            f"cluster.tasks_per_node={c.tasks_per_node} differs from cluster.nproc_per_node={c.nproc_per_node}; "
            "on SLURM set cluster.tasks_per_node only"
        )
    if c.partition:
        known = partitions()
        if known is not None and c.partition not in known:
            raise UserError(
                f"cluster.partition={c.partition} is not a partition of this SLURM cluster "
                f"(it has: {', '.join(sorted(known)) or 'none'})"
            )


def partitions() -> set[str] | None:
    """Partition names as sinfo lists them (None if sinfo cannot answer)."""
    try:
        proc = subprocess.run(["sinfo", "-h", "-o", "%R"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        raise UserError(f"cluster.launcher=slurm but SLURM does not answer (sinfo: "
                        f"{(proc.stderr.strip().splitlines()[-1:] or ['?'])[0]}); check that slurmctld is up "
                        "(sinfo) or use cluster=local_cpu")
    return {line.strip() for line in proc.stdout.splitlines() if line.strip()}
