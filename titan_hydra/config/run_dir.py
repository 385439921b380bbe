"""The run directory's name (``hydra.run.dir: outputs/${th_run_subdir:}``)."""

from __future__ import annotations

import os
import time
from typing import Optional

_RUN_STAMP: Optional[str] = None


def run_subdir() -> str:
    """A run directory name that every rank of one run computes identically.

    Under torchrun each rank composes its own config, so a timestamp would split ranks into
    different directories. torchrun's rendezvous id (random per ``--standalone`` run, or the
    user's ``--rdzv-id``) and SLURM's job id are shared by all ranks and survive a requeue.
    """
    global _RUN_STAMP
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and os.environ.get("TITAN_HYDRA_WORKER") is None:
        return f"torchrun/{run_id}"
    job = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    if job and os.environ.get("SUBMITIT_FOLDER") is None and os.environ.get("SLURM_STEP_ID"):
        task = os.environ.get("SLURM_ARRAY_TASK_ID")
        return f"slurm/{job}" + (f"_{task}" if task else "")
    if _RUN_STAMP is None:
        _RUN_STAMP = time.strftime("%Y-%m-%d/%H-%M-%S")
    return _RUN_STAMP
