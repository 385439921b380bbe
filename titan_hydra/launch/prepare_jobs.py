"""Corpus preparation on SLURM: one job of N tasks, each tokenizing its share of the inputs.

``recipes/prepare_data.py cluster=slurm cluster.nnodes=8`` (any SLURM cluster config) submits
one job through submitit with ``cluster.nnodes x cluster.tasks_per_node`` tasks; task ``r`` of
``n`` prepares inputs ``r, r + n, ...`` with ``cluster.cpus_per_task`` worker processes
(``data.prepare.prepare_part``). The submitting process checks the settings before anything is
submitted, waits, and writes the manifest itself once every input has its ``done`` record. Shard
names carry the input's index, so the corpus is byte-identical to a one-machine preparation; a
job killed half way resumes by running the same command again (finished inputs are skipped),
and each requeued task (submitit's ``checkpoint``) does the same.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from titan_hydra.data.documents import Input
from titan_hydra.data.prepare import PrepareSettings, begin, finish, prepare_part
from titan_hydra.launch.slurm import executor_params, release
from titan_hydra.launch.slurm_check import check_slurm
from titan_hydra.launch.submitit_jobs import JobFailed, failure_of, job_log


class PrepareTask:
    """What each SLURM task runs: its share of the inputs (submitit pickles this object)."""

    def __init__(self, files: list[Input], settings: PrepareSettings, workers: int) -> None:
        self.files, self.settings, self.workers = files, settings, workers

    def __call__(self) -> int:
        import submitit

        env = submitit.JobEnvironment()
        return prepare_part(self.files, self.settings, self.workers, env.global_rank, env.num_tasks)

    def checkpoint(self) -> Any:
        """Requeue after a timeout or preemption: the same share again (finished inputs are skipped)."""
        import submitit

        return submitit.helpers.DelayedSubmission(PrepareTask(self.files, self.settings, self.workers))


def submit_prepare(cfg: DictConfig, files: list[Input], settings: PrepareSettings) -> tuple[dict[str, Any], int]:
    """Prepare ``files`` with one SLURM job; returns (the manifest, the number of tasks)."""
    import submitit

    check_slurm(cfg)
    out = begin(files, settings)
    executor = submitit.AutoExecutor(folder=str(out / ".submitit" / "%j"), cluster="slurm",
                                     slurm_max_num_timeout=int(cfg.cluster.max_requeue))
    params = executor_params(cfg, name="prepare_data")
    params.pop("gpus_per_node", None)  # tokenizing needs no GPU
    executor.update_parameters(**params)
    tasks = int(cfg.cluster.nnodes) * int(cfg.cluster.nproc_per_node)
    workers = int(cfg.cluster.cpus_per_task or 1)
    job = executor.submit(PrepareTask(files, settings, workers))
    release(job.job_id)  # submitted held (launch/slurm.py: HOLD)
    print(f"submitted SLURM job {job.job_id}: {tasks} task(s) x {workers} worker(s) for {len(files)} input(s); "
          f"logs in {Path(job.paths.stdout).parent}", flush=True)
    _, line = failure_of(job)
    if line is not None:
        raise JobFailed(f"SLURM job {job.job_id} failed: {line} (log: {job_log(job)})")
    return finish(files, settings), tasks
