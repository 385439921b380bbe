"""From a composed config to running ranks: compose -> resolve -> validate -> RunSpec -> run.

``launch(cfg)`` resolves what the config leaves open (a sweep job's W&B identity,
``parallelism=auto``: the only changes made to the config, all before validation), builds the
run's ``RunSpec`` once and validates it (one-line ``error:`` and exit 2 on bad input), prints
the plan for ``dry_run`` (or simulates the run for ``dry_run=simulate``: titan_hydra/simulate;
both leave their figures in the run dir, and a sweep of them is tabulated: launch/dry_run.py),
and otherwise hands the spec to the pretraining recipe: in this process when it is the only
rank or when an outer launcher (torchrun, SLURM) already made this process a rank, or in
workers that the local launcher spawns through torch elastic.
"""

from __future__ import annotations

import os
import sys

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from titan_hydra.errors import UserError
from titan_hydra.launch.dry_run import dry_run, record_refusal, refusal_is_a_result
from titan_hydra.launch.ft_local import run_groups
from titan_hydra.launch.local import run_local
from titan_hydra.launch.run_lock import RunDirLock, owns_run
from titan_hydra.launch.slurm import export_dist_env, in_slurm_step, in_submitit_job, submit
from titan_hydra.launch.submitit_jobs import JobFailed
from titan_hydra.launch.sweep import apply_sweep_identity
from titan_hydra.launch.resolve import resolved_spec
from titan_hydra.runtime.fault_tolerance import GROUP_ENV
from titan_hydra.train.pretrain import run
from titan_hydra.validate import check_spec


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def hydra_output_dir() -> str | None:
    try:
        return HydraConfig.get().runtime.output_dir
    except ValueError:  # not under Hydra (tests calling launch directly)
        return None


def run_dir_of(cfg: DictConfig) -> str:
    return hydra_output_dir() or os.getcwd()


def refuse(cfg: DictConfig, run_dir: str | None, message: str) -> None:
    """``error: ...`` and exit 2; a layout of a sweep of dry runs instead records its refusal as
    its result and returns, so the sweep goes on (titan_hydra/launch/dry_run.py)."""
    if not refusal_is_a_result(cfg):
        fail(message)
    record_refusal(run_dir or run_dir_of(cfg), message)


def launch(cfg: DictConfig, run_dir: str | None = None) -> float | None:
    """Validate, then dry-run or train in ``run_dir`` (None: Hydra's output dir, or the working
    directory outside Hydra). Returns the final validation loss (for sweepers)."""
    export_dist_env(cfg)  # a SLURM / submitit task becomes its rank
    submit_to_slurm = cfg.cluster.launcher == "slurm" and not (in_slurm_step() or in_submitit_job())
    try:
        apply_sweep_identity(cfg)  # W&B group / name of a multirun job
        spec = resolved_spec(cfg)  # built once; parallelism=auto -> concrete degrees, before anything checks them
        # a SLURM submit host leaves the device checks to the compute nodes
        spec = check_spec(spec, environment=not submit_to_slurm)
    except UserError as e:
        return refuse(cfg, run_dir, str(e))
    if spec.dry_run:  # the plan, or (simulate) the run built and stepped on fake tensors beside it
        # (files where a run dir is known: Hydra's, the caller's; a simulation outside Hydra: here)
        try:
            dry_run(spec, run_dir or hydra_output_dir() or (os.getcwd() if spec.simulate else None))
        except UserError as e:
            return refuse(cfg, run_dir, str(e))
        return None
    run_dir = run_dir or run_dir_of(cfg)
    inside_rank = "LOCAL_RANK" in os.environ or spec.world_size == 1
    # torchft: this process starts the replica groups (each a launch.py run of its own)
    # (a rank that torchrun started is already inside its group: TITAN_HYDRA_FT_GROUP, or group 0)
    # (fault_tolerance.group=<g>: this launch is that one group, started on its own)
    ft_groups = (spec.fault_tolerant and not spec.fault_tolerance.starts_alone
                 and GROUP_ENV not in os.environ and "LOCAL_RANK" not in os.environ)
    lock = RunDirLock(run_dir)
    try:
        if owns_run(submit_to_slurm) and not ft_groups:  # group 0 holds the run dir's lock
            lock.acquire()  # one run per run dir; released when this process ends, however
        if submit_to_slurm:
            summary = submit(cfg, run_dir)  # each task validates its own spec on its node
        elif ft_groups:
            summary = run_groups(spec, run_dir, list(HydraConfig.get().overrides.task))
        elif inside_rank:
            summary = run(spec, run_dir)
        else:
            summary = run_local(spec, run_dir)
    except UserError as e:
        fail(str(e))
    except JobFailed as e:  # a submitted job died: its one-line error and log, exit 1
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    finally:
        lock.release()
    val = summary.get("final_val_loss") if summary else None
    return float(val) if val is not None else (summary or {}).get("final_loss")
