"""A sweep through submitit, every failed job reported as one line.

hydra-submitit-launcher collects results with ``[job.results()[0] for job in jobs]``: the first
job that died raises submitit's ``UncompletedJobError``, whose 20-line traceback buries the
job's own one-line ``error: ...`` (it sits in the job's stderr log), and the jobs after it are
never looked at. Here every job is waited for, and each failed one prints

    sweep job #1 [optimizer.lr=0.1] failed: <its one-line error> (log: <its stderr file>)

and gets a ``status.json`` (FAILED + that line) in its run dir for ``recipes/sweep_report.py``.
Then one summary line (how many failed, where the sweep is) and exit status 1. Under the basic
sweeper the launcher ends the sweep itself (that sweeper stops at the first failure anyway);
other sweepers (optuna, ...) get FAILED ``JobReturn``s carrying ``SweepJobsFailed``, a Hydra
"compact" exception, so a sweeper that tolerates failures can, and one that re-raises makes
Hydra print that line without a traceback.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, Sequence

from hydra.errors import CompactHydraException
from omegaconf import DictConfig, OmegaConf, open_dict

from titan_hydra.launch.sweep_check import BASIC_SWEEPER, first_problem


class SweepJobsFailed(CompactHydraException):
    """Some jobs of a sweep failed; each was already reported on its own line."""


class JobFailed(RuntimeError):
    """One submitted job (``launch.py cluster=slurm`` without -m) failed; the message is one line."""


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failure)\b(: |$)")


def error_line(log_text: str | None) -> str | None:
    """The one line that says why a job failed, from its log: the last ``error: ...`` line
    (launch.py's report of bad input), else the last exception line of a traceback or ``hang:``
    line (the health watchdog's, when the job could not be requeued), else what SLURM's step
    daemon said (``*** JOB 12 CANCELLED ... DUE TO TIME LIMIT ***``)."""
    lines = [line.strip() for line in (log_text or "").splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("error: "):
            return line[len("error: "):]
    for line in reversed(lines):
        if _EXCEPTION_LINE.match(line) or line.startswith("hang: "):
            return line
    for line in reversed(lines):
        if line.startswith("slurmstepd: error: "):
            return line[len("slurmstepd: error: "):]
    return None


def job_log(job: Any) -> str:
    """Where a job's stderr went (rank 0's), for the user to read."""
    path = job.paths.stdout if _stderr_to_stdout(job) else job.paths.stderr
    return str(path)


def _stderr_to_stdout(job: Any) -> bool:
    return not Path(job.paths.stderr).exists() and Path(job.paths.stdout).exists()


def failure_of(job: Any) -> tuple[Any, str | None]:
    """(rank 0's result or None, one-line error or None when the job completed). A result that
    is a Hydra ``JobReturn`` counts as failed when its status says so."""
    from hydra.core.utils import JobReturn, JobStatus

    try:
        ret = job.results()[0]
    except Exception as e:  # noqa: BLE001  (submitit's UncompletedJobError / FailedJobError, a lost job)
        logs = "\n".join(text for text in (_read(job.stderr), _read(job.stdout)) if text)
        line = error_line(logs) or error_line(str(e)) or f"it ended without a result or an error line (state {job.state})"
        return None, line
    if not isinstance(ret, JobReturn) or ret.status == JobStatus.COMPLETED:
        return ret, None
    error = ret._return_value
    lines = str(error).strip().splitlines()
    return ret, f"{type(error).__name__}: {lines[-1] if lines else ''}".rstrip(": ")


def _read(getter) -> str | None:
    try:
        return getter()
    except OSError:
        return None


def run_dir_of(config_loader: Any, config: DictConfig, overrides: Sequence[str], num: int) -> Path:
    """The run dir Hydra gives job ``num`` (``hydra.sweep.dir/hydra.sweep.subdir``)."""
    job_cfg = config_loader.load_sweep_config(config, list(overrides))
    with open_dict(job_cfg):
        job_cfg.hydra.job.num = num
    return Path(str(OmegaConf.select(job_cfg, "hydra.sweep.dir"))) / str(OmegaConf.select(job_cfg, "hydra.sweep.subdir"))


def record_failure(run_dir: Path, line: str, job_id: str, overrides: Sequence[str]) -> None:
    """status.json for a job that died before Hydra could write one (it exited on bad input)."""
    status = run_dir / "status.json"
    if status.exists():
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    status.write_text(json.dumps({"status": "FAILED", "error": line[:2000], "job_id": job_id,
                                  "overrides": list(overrides)}, indent=1))


def varying(job_overrides: Sequence[Sequence[str]]) -> list[list[str]]:
    """Each job's overrides that differ across the batch (all of them for a batch of one)."""
    values: dict[str, set[str]] = {}
    for overrides in job_overrides:
        for o in overrides:
            key, _, value = o.partition("=")
            values.setdefault(key, set()).add(value)
    differ = {k for k, v in values.items() if len(v) > 1 or len(job_overrides) == 1}
    return [[o for o in launcher_shown(overrides) if o.partition("=")[0] in differ] for overrides in job_overrides]


class ResultGrace:
    """One shared wait for result files that a network filesystem has not shown yet.

    submitit waits up to 15 s for the result file of every ended job that has none, so an array
    of N failed jobs took N x 15 s to report. Here the first ended job without a result starts
    one grace period that every later one shares (local jobs: 1 s; their filesystem is here).
    """

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.deadline: float | None = None

    def apply(self, job: Any) -> None:
        import time

        job.wait()
        if Path(job.paths.result_pickle).exists():
            return
        now = time.monotonic()
        if self.deadline is None:
            self.deadline = now + self.seconds
        for one in (job, *getattr(job, "_sub_jobs", ())):  # a multi-task job reads each task's file
            one._results_timeout_s = max(1.0, self.deadline - now)


def collect(launcher: Any, jobs: Sequence[Any], job_overrides: Sequence[Sequence[str]], first_num: int) -> list:
    """Every job's JobReturn, in order; a failed job is one printed line and a FAILED JobReturn.
    Under the basic sweeper, which would stop at the first FAILED JobReturn and re-raise it in
    Hydra's framing, the sweep ends here instead: one summary line, exit status 1."""
    from hydra.core.utils import JobReturn, JobStatus


    returns, failed = [], []
    labels = varying(job_overrides)
    grace = ResultGrace(seconds=1.0 if launcher._EXECUTOR == "local" else 15.0)
    for num, (job, overrides, label) in enumerate(zip(jobs, job_overrides, labels), start=first_num):
        grace.apply(job)
        ret, line = failure_of(job)
        if line is None:
            returns.append(ret)
            continue
        print(f"sweep job #{num} [{' '.join(label)}] failed: {line} (log: {job_log(job)})", file=sys.stderr, flush=True)
        try:
            record_failure(run_dir_of(launcher.hydra_context.config_loader, launcher.config, overrides, num),
                           line, str(job.job_id), overrides)
        except Exception:  # noqa: BLE001  (the report is a convenience; the line above is the news)
            pass
        ret = ret or JobReturn(overrides=list(overrides))
        ret.status = JobStatus.FAILED
        failed.append(num)
        returns.append(ret)
    if failed:
        sweep_dir = OmegaConf.select(launcher.config, "hydra.sweep.dir")
        summary = SweepJobsFailed(
            f"error: {len(failed)} of {len(jobs)} sweep jobs failed (#{', #'.join(map(str, failed))}, "
            f"listed above); python recipes/sweep_report.py {sweep_dir} tabulates the sweep"
        )
        if OmegaConf.select(launcher.config, "hydra.sweeper._target_") == BASIC_SWEEPER:
            print(summary, file=sys.stderr, flush=True)
            sys.exit(1)
        for ret in returns:
            if ret.status == JobStatus.FAILED:
                ret._return_value = summary
    return returns


def launcher_shown(overrides: Sequence[str]) -> list[str]:
    from hydra.core.utils import filter_overrides

    return list(filter_overrides(overrides))


def executor_of(launcher: Any):
    """The submitit executor hydra-submitit-launcher would build from the launcher's params."""
    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

    params = dict(launcher.params)
    init = {"folder": params.pop("submitit_folder")}
    if "max_num_timeout" in params:
        init[f"{launcher._EXECUTOR}_max_num_timeout"] = params.pop("max_num_timeout")
    executor = submitit.AutoExecutor(cluster=launcher._EXECUTOR, **init)
    common = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{k if k in common else f"{launcher._EXECUTOR}_{k}": v for k, v in params.items()})
    return executor


def submit(launcher: Any, job_overrides: Sequence[Sequence[str]], first_num: int) -> list:
    """Submit every job as one submitit array (one SLURM array on SLURM); the jobs."""
    from hydra.core.singleton import Singleton

    executor = executor_of(launcher)
    sweep_dir = Path(str(launcher.config.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    print(f"submitit '{launcher._EXECUTOR}' sweep, dir {sweep_dir}", flush=True)
    args = []
    for num, overrides in enumerate(job_overrides, start=first_num):
        print(f"\t#{num} : {' '.join(launcher_shown(overrides))}", flush=True)
        args.append((list(overrides), "hydra.sweep.dir", num, f"job_id_for_{num}", Singleton.get_state()))
    return executor.map_array(launcher, *zip(*args))


def write_manifest(sweep_dir: Path, job_overrides: Sequence[Sequence[str]], first_num: int) -> None:
    """jobs.json in the sweep dir: every job's number and overrides, so that the sweep report
    can list a job that never started (its run dir does not exist) as failed."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    path = sweep_dir / "jobs.json"
    jobs = json.loads(path.read_text()) if path.exists() else []
    jobs += [{"num": first_num + i, "overrides": list(o)} for i, o in enumerate(job_overrides)]
    path.write_text(json.dumps(jobs, indent=1))


class OneLineFailures:
    """Mixin for a hydra-submitit-launcher class: check the batch's points, submit them, report
    each failed job in one line (the module doc). Subclasses may extend ``prepare``."""

    def prepare(self, job_overrides: Sequence[Sequence[str]], first_num: int) -> None:
        """Refuse a batch with a bad point (one ``error:`` line, exit 2) before submitting."""

        problem = first_problem(self.hydra_context.config_loader, self.config, job_overrides, first_num)
        if problem is not None:
            print(f"error: {problem}", file=sys.stderr, flush=True)
            sys.exit(2)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int):
        self.prepare(job_overrides, initial_job_idx)
        write_manifest(Path(str(self.config.hydra.sweep.dir)), job_overrides, initial_job_idx)
        jobs = submit(self, job_overrides, initial_job_idx)
        self.submitted(jobs)
        return collect(self, jobs, job_overrides, initial_job_idx)

    def submitted(self, jobs: Sequence[Any]) -> None:
        """Called once the array is submitted (the SLURM launcher prints the array id)."""
