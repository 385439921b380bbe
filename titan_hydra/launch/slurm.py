"""SLURM launching through submitit: one SLURM task per torch.distributed rank.

Two ways in, one mechanism:
- ``python launch.py cluster=slurm_local`` (no ``-m``): ``submit()`` sends one job through
  submitit and waits for rank 0's summary. The run dir was chosen by the submitting process and
  travels inside the pickled job, so every task and every requeue of the job writes there.
- ``python launch.py -m ... cluster=slurm_local``: the `cluster` option selects the Hydra
  launcher ``hydra/launcher=titan_slurm`` (``SlurmLauncher`` below, a subclass of
  hydra-submitit-launcher's). Each sweep job is one SLURM array element; its run dir is
  ``<sweep dir>/<job num>``, fixed before submission, so requeues find their checkpoint.

Inside a job each task derives RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from
SLURM (``export_dist_env``) and runs the recipe as that rank; multi-node is the same code. The
master is the job's first node, under its NodeAddr when its name does not resolve, and joining
it is bounded by ``cluster.init_timeout_s`` (``rendezvous.py``).
On SLURM's pre-timeout / preemption signal submitit calls the job's ``checkpoint()``, which
resubmits the same call (``DelayedSubmission``); the requeued job restores the latest
checkpoint of its run dir (``checkpoint=default``) and continues. A hang the health watchdog
catches requeues the job the same way (``runtime/preemption.requeue_on_hang``).

Bad input (no ``sbatch``, an unknown partition, a sweep override that does not compose or
validate) fails in the submitting process with one ``error: ...`` line, before any submission.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any, Sequence

from omegaconf import DictConfig

from titan_hydra.errors import UserError
from titan_hydra.launch.slurm_check import check_slurm
from titan_hydra.runtime.rendezvous import master_address
from titan_hydra.train.pretrain import run
from titan_hydra.validate import validate
from titan_hydra.launch.submitit_jobs import JobFailed, OneLineFailures, failure_of, job_log

try:  # the Hydra plugin is a dependency; keep this module importable without it for unit use
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import (
        SlurmLauncher as _HydraSlurmLauncher,
    )
except ImportError:  # pragma: no cover
    _HydraSlurmLauncher = object  # type: ignore[assignment,misc]


# ---------------------------------------------------------------- the torch.distributed environment


def in_slurm_step() -> bool:
    """True inside an ``srun`` step (each task of a submitit SLURM job is one)."""
    return "SLURM_PROCID" in os.environ and "SLURM_STEP_ID" in os.environ


def in_submitit_job() -> bool:
    return bool(os.environ.get("SUBMITIT_EXECUTOR"))


def _first_host(nodelist: str) -> str:
    """First host of a SLURM node list (``scontrol show hostnames`` expands ranges)."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, timeout=30, check=True).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return nodelist.split(",")[0].split("[")[0]


def ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The first port of the kernel's ephemeral range (Linux default 32768)."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_of(job_id: str) -> int:
    """A port every task of one job computes alike (and a requeue of it too), below the ephemeral
    range: there the kernel hands ports to every outgoing connection and to gloo's own listeners,
    so a port derived from the job id could already be taken on the node (seen in CI: submitit's
    20000-60000 choice failed with EADDRINUSE while other runs shared the machine)."""
    span = max(ephemeral_low() - 20000, 1000)
    return 20000 + zlib.crc32(job_id.encode()) % span


def slurm_dist_env(master_port: int | None = None) -> dict[str, str]:
    """RANK / LOCAL_RANK / WORLD_SIZE / LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT from SLURM."""
    e = os.environ
    ntasks = int(e.get("SLURM_NTASKS") or e.get("SLURM_NPROCS") or 1)
    nnodes = int(e.get("SLURM_JOB_NUM_NODES") or e.get("SLURM_NNODES") or 1)
    nodelist = e.get("SLURM_JOB_NODELIST") or e.get("SLURM_NODELIST") or "127.0.0.1"
    return {
        "RANK": e.get("SLURM_PROCID", "0"),
        "LOCAL_RANK": e.get("SLURM_LOCALID", "0"),
        "WORLD_SIZE": str(ntasks),
        "LOCAL_WORLD_SIZE": str(max(1, ntasks // nnodes)),
        "MASTER_ADDR": e.get("MASTER_ADDR") or master_address(_first_host(nodelist)),
        "MASTER_PORT": str(master_port or e.get("MASTER_PORT") or port_of(e.get("SLURM_JOB_ID", "0"))),
    }


def submitit_dist_env() -> dict[str, str]:
    """The same variables from submitit's job environment (SLURM or submitit_local)."""
    from submitit import JobEnvironment
    from submitit.helpers import TorchDistributedEnvironment

    d = TorchDistributedEnvironment()
    # submitit names the first node; on SLURM that name may not resolve (its NodeAddr does).
    addr = master_address(d.master_addr) if os.environ.get("SLURM_JOB_ID") else d.master_addr
    # submitit's port (random in 20000-60000, seeded by the job id) can fall in the ephemeral range.
    port = os.environ.get("MASTER_PORT") or port_of(str(JobEnvironment().job_id))
    return {"RANK": str(d.rank), "LOCAL_RANK": str(d.local_rank), "WORLD_SIZE": str(d.world_size),
            "LOCAL_WORLD_SIZE": str(d.local_world_size), "MASTER_ADDR": addr, "MASTER_PORT": str(port)}


def export_dist_env(cfg: DictConfig) -> bool:
    """Make this process a rank when an outer launcher (SLURM, submitit) started it as a task.

    Exports when this process is one of several tasks, or when the cluster is a SLURM one.
    A single submitit_local task of a multi-process local cluster keeps spawning its own
    workers instead. Returns whether anything was exported.
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return False  # torchrun or an earlier call already did it
    if in_submitit_job():
        env = submitit_dist_env()
    elif in_slurm_step():
        env = slurm_dist_env()
    else:
        return False
    if int(env["WORLD_SIZE"]) == 1 and cfg.cluster.launcher != "slurm":
        return False
    if cfg.cluster.master_port:
        env["MASTER_PORT"] = str(cfg.cluster.master_port)
    os.environ.update(env)  # LOCAL_WORLD_SIZE and SLURM's CPUs per task set the rank's threads (runtime/threads.py)
    return True


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


# submitit creates a job's log folder (.submitit/<job id>) only after sbatch has returned the id;
# an idle SLURM older than 23.02 can start the task first, fail to open its log there and kill it
# ("Could not open stdout file"). Jobs go out held and are released once submitit has made their
# folders.
HOLD = {"hold": True}


def release(job_id: str) -> None:
    """Release a job (or a whole array) submitted with ``HOLD``; cancel it if that fails, so
    that nothing waits forever on a job that will never start."""
    done = subprocess.run(["scontrol", "release", job_id], capture_output=True, text=True)
    if done.returncode != 0:
        subprocess.run(["scancel", job_id], capture_output=True)
        why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[0]
        raise UserError(f"scontrol release {job_id} failed ({why}); "
                        "the job was cancelled: check that this user may release its own jobs")


# ---------------------------------------------------------------- one job without -m


def executor_params(cfg: DictConfig, name: str = "titan_hydra") -> dict[str, Any]:
    """submitit AutoExecutor parameters from the cluster config (None / 0 GPUs left out)."""
    c = cfg.cluster
    params: dict[str, Any] = {
        "name": name,
        "nodes": int(c.nnodes),
        "tasks_per_node": int(c.nproc_per_node),
        "timeout_min": int(c.timeout_min),
        "cpus_per_task": c.cpus_per_task,
        "mem_gb": c.mem_gb,
        "gpus_per_node": c.gpus_per_node or None,
        "slurm_partition": c.partition,
        "slurm_account": c.account,
        "slurm_qos": c.qos,
        "slurm_constraint": c.constraint,
        "slurm_setup": list(c.setup) or None,
        "slurm_signal_delay_s": int(c.signal_delay_s),
        "slurm_additional_parameters": dict(HOLD),
    }
    return {k: v for k, v in params.items() if v is not None}


class RankTask:
    """What each SLURM task of a ``submit()`` job runs: become a rank, train, return a summary.

    ``checkpoint()`` is submitit's requeue hook: it resubmits this same task, which resumes
    from the run dir's latest checkpoint.
    """

    def __init__(self, cfg: DictConfig, run_dir: str):
        self.cfg = cfg
        self.run_dir = run_dir

    def __call__(self) -> dict[str, Any]:

        export_dist_env(self.cfg)
        try:
            summary = run(validate(self.cfg), self.run_dir)  # this node's environment decides
        except UserError as e:  # the line the submitting process reports (submitit_jobs.error_line)
            print(f"error: {e}", file=sys.stderr, flush=True)
            raise
        return {k: v for k, v in summary.items() if k in ("final_loss", "final_val_loss", "losses", "run_dir")}

    def checkpoint(self) -> Any:
        import submitit

        return submitit.helpers.DelayedSubmission(RankTask(self.cfg, self.run_dir))


def submit(cfg: DictConfig, run_dir: str) -> dict[str, Any]:
    """Submit one job for this run, wait for it, return rank 0's summary."""
    import submitit

    check_slurm(cfg)
    executor = submitit.AutoExecutor(folder=str(Path(run_dir) / ".submitit" / "%j"), cluster="slurm",
                                     slurm_max_num_timeout=int(cfg.cluster.max_requeue))
    executor.update_parameters(**executor_params(cfg))
    job = executor.submit(RankTask(cfg, run_dir))
    release(job.job_id)
    print(f"submitted SLURM job {job.job_id}; run dir {run_dir}", flush=True)
    ret, line = failure_of(job)
    if line is not None:
        raise JobFailed(f"SLURM job {job.job_id} failed: {line} (log: {job_log(job)})")
    return ret


# ---------------------------------------------------------------- the Hydra launcher (-m)


class SlurmLauncher(OneLineFailures, _HydraSlurmLauncher):  # type: ignore[misc,valid-type]
    """hydra-submitit-launcher's SLURM launcher, made rank-aware and careful.

    - every task becomes a rank in ``launch.py``'s entry (``export_dist_env``).
    - ``launch`` checks that this machine can submit, and composes and validates every sweep
      point not already checked by ``SweepCheckCallback``, before submitting any.
    - all jobs go out as one SLURM array; each failed job is one line on the console and a
      FAILED row in the sweep report, not a traceback (``submitit_jobs.OneLineFailures``).
    - ``cluster.setup`` lines are added to the sbatch script.
    ``checkpoint`` (inherited) resubmits the same call on timeout/preemption.
    """

    def prepare(self, job_overrides: Sequence[Sequence[str]], first_num: int) -> None:
        assert self.config is not None
        try:
            check_slurm(self.config)
        except UserError as e:
            fail(str(e))
        super().prepare(job_overrides, first_num)
        if self.config.cluster.setup:
            self.params["setup"] = list(self.config.cluster.setup)
        if not self.params.get("gpus_per_node"):
            self.params.pop("gpus_per_node", None)
        self.params["additional_parameters"] = {**(self.params.get("additional_parameters") or {}), **HOLD}

    def submitted(self, jobs: Sequence[Any]) -> None:
        try:
            release(jobs[0].job_id.split("_")[0])
        except UserError as e:
            fail(str(e))
        print(f"submitted SLURM array {jobs[0].job_id.split('_')[0]} ({len(jobs)} jobs), "
              f"sweep dir {self.config.hydra.sweep.dir}", flush=True)
