"""How many CPU threads each process of a run uses, and why: one decision for every launcher.

torch starts with one intra-op thread per core in every process, so N processes on one host
run N x cores threads on cores that fit one set: two torchft replica groups on 2 cores ran at
a quarter of one process's tok/s each. Every launcher (torch elastic, torchrun, torchft groups,
SLURM tasks, submitit's local jobs) therefore gives each process its share of the usable cores
(``os.sched_getaffinity``): cores // processes on this host. ``cluster.threads_per_proc`` sets
the count outright; OMP_NUM_THREADS in the environment can only lower it (tests and shared
machines run one thread per process; a launcher passes its children the count it chose there).
Inside a SLURM task the CPUs SLURM granted it (SLURM_CPUS_PER_TASK) are its share.

Processes on this host = the sibling launches sharing it (``LAUNCHES_ENV``: torchft groups,
the jobs of a local sweep) x this launch's local processes (LOCAL_WORLD_SIZE, which torch
elastic, torchrun, SLURM and submitit set for each rank).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator, Mapping, Optional

# How many launches share this host's cores (set by a launcher that starts several on it).
LAUNCHES_ENV = "TITAN_HYDRA_LAUNCHES_ON_HOST"


@dataclass(frozen=True)
class Threads:
    n: int
    reason: str  # e.g. "2 cores / 2 processes on this host", "cluster.threads_per_proc"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 'es' if word.endswith('s') else 's'}"


def threads_for(cores: int, processes: int, override: Optional[int] = None, cap: Optional[int] = None,
                slurm_cpus: Optional[int] = None) -> Threads:
    """Threads for one process: ``override`` (cluster.threads_per_proc) if set; else the
    ``slurm_cpus`` a SLURM task was granted (at most ``cores``), or an equal share of ``cores``
    among ``processes``; lowered to ``cap`` (OMP_NUM_THREADS) when that is smaller."""
    if override:
        return Threads(int(override), "cluster.threads_per_proc")
    if slurm_cpus:
        n = min(slurm_cpus, cores)
        why = f"{slurm_cpus} CPUs per SLURM task" + (f", {cores} usable" if cores < slurm_cpus else "")
    else:
        n = max(1, cores // max(1, processes))
        why = f"{_plural(cores, 'core')} / {_plural(processes, 'process')} on this host"
    if cap and cap < n:
        return Threads(cap, f"OMP_NUM_THREADS={cap}; {why} allow {n}")
    return Threads(n, why)


def usable_cores() -> int:
    """Cores this process may run on (its affinity: a container's or a SLURM task's binding)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _positive(value: Optional[str]) -> Optional[int]:
    try:
        n = int(value or "")
    except ValueError:
        return None
    return n if n > 0 else None


def threads_here(override: Optional[int] = None, local_processes: Optional[int] = None,
                 environ: Mapping[str, str] = os.environ, cores: Optional[int] = None) -> Threads:
    """``threads_for`` this process from its environment. ``local_processes``: the workers a
    launcher is about to start here (default: LOCAL_WORLD_SIZE, or 1 for a lone process)."""
    local = local_processes or _positive(environ.get("LOCAL_WORLD_SIZE")) or 1
    launches = _positive(environ.get(LAUNCHES_ENV)) or 1
    # a SLURM task that is itself a rank (not a torch elastic worker that a task started)
    slurm_task = (local_processes is None and "SLURM_STEP_ID" in environ and "SLURM_PROCID" in environ
                  and "TORCHELASTIC_RUN_ID" not in environ)
    return threads_for(cores or usable_cores(), launches * local, override=override,
                       cap=_positive(environ.get("OMP_NUM_THREADS")),
                       slurm_cpus=_positive(environ.get("SLURM_CPUS_PER_TASK")) if slurm_task else None)


def launches_env(launches: int, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The environment entry for ``launches`` sibling launches started from this one (which may
    itself be one of several)."""
    return {LAUNCHES_ENV: str(launches * (_positive(environ.get(LAUNCHES_ENV)) or 1))}


@contextlib.contextmanager
def exported(env: Mapping[str, str]) -> Iterator[None]:
    """``env`` in os.environ while children start (they inherit it), as it was afterwards: a later
    run in this process must not read a launcher's OMP_NUM_THREADS as the user's cap."""
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
