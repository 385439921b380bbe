"""Fault-tolerant runs on this machine: a torchft Lighthouse and ``replica_groups`` launches.

``python launch.py fault_tolerance=torchft fault_tolerance.replica_groups=2`` lands here. Each
replica group is an ordinary ``launch.py`` run of ``cluster.nproc_per_node`` ranks in its own
process tree, told its index and the Lighthouse through the environment
(``runtime/fault_tolerance.py``); group 0 runs in the run dir (its metrics, checkpoints and
status are the run's), group g in ``<run dir>/replica_groups/g``. The launcher starts the
Lighthouse (torchft's binary, from its wheel) on a free local port, starts the groups, and
restarts a group that exits with an error, up to ``fault_tolerance.max_restarts`` times per
group: the restarted group rejoins the quorum and receives the live state from a peer. The run
ends when every group has ended; its status is group 0's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable


from titan_hydra.errors import RankFailed, UserError
from titan_hydra.runtime.fault_tolerance import (
    GROUP_ENV, LIGHTHOUSE_ENV, START_BARRIER_ENV, FaultTolerance, check_lighthouse,
)
from titan_hydra.runtime.rendezvous import free_port
from titan_hydra.runtime.threads import launches_env, threads_here
from titan_hydra.spec import RunSpec

GROUPS_DIR = "replica_groups"
POLL_S = 0.2


def group_dir(run_dir: str, group: int) -> Path:
    return Path(run_dir) if group == 0 else Path(run_dir) / GROUPS_DIR / str(group)


def lighthouse_binary() -> str:
    """torchft's Lighthouse, installed beside this interpreter by the torchft wheel."""
    found = shutil.which("torchft_lighthouse", path=os.path.dirname(sys.executable) + os.pathsep
                         + os.environ.get("PATH", ""))
    if found is None:
        raise UserError("fault_tolerance=torchft needs torchft's torchft_lighthouse binary; "
                        "pip install torchft==0.2.0 (it is in the wheel)")
    return found


def start_lighthouse(ft: FaultTolerance, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [lighthouse_binary(), "--min_replicas", str(int(ft.min_replicas)), "--quorum_tick_ms", "100",
           "--join_timeout_ms", str(int(ft.join_timeout_ms)), "--bind", f"127.0.0.1:{port}"]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def run_groups(spec: RunSpec, run_dir: str, overrides: list[str]) -> dict[str, Any]:
    """Start the Lighthouse and every group (each a ``launch.py`` run of its own, with the same
    ``overrides``), restart groups that fail, return group 0's summary."""
    ft, cluster = spec.fault_tolerance, spec.cluster
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    if ft.lighthouse:
        check_lighthouse(str(ft.lighthouse))
    lighthouse, addr = (None, str(ft.lighthouse)) if ft.lighthouse else start_lighthouse(
        ft, Path(run_dir) / "lighthouse.log")
    print(f"fault tolerance: {int(ft.replica_groups)} replica groups, Lighthouse {addr}", flush=True)
    procs: dict[int, subprocess.Popen] = {}
    restarts = {g: 0 for g in range(int(ft.replica_groups))}

    barrier = Path(run_dir) / GROUPS_DIR / f"started-{time.time_ns()}"
    barrier.mkdir(parents=True)
    # the groups share this host's cores: each of their processes gets its share, not all of them
    shared = launches_env(int(ft.replica_groups))
    threads = threads_here(cluster.threads_per_proc, local_processes=int(cluster.nproc_per_node),
                           environ={**os.environ, **shared})
    shared["OMP_NUM_THREADS"] = str(threads.n)

    def start(group: int, first: bool = False) -> subprocess.Popen:
        out = group_dir(run_dir, group)
        out.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **shared, GROUP_ENV: str(group), LIGHTHOUSE_ENV: addr}
        if first:  # the groups of this launch wait for each other once; a restarted group joins alone
            env[START_BARRIER_ENV] = str(barrier)
        cmd = [sys.executable, str(Path(sys.argv[0]).resolve()), *overrides, f"hydra.run.dir={out}"]
        if group == 0:  # group 0 speaks on this console; the others write to their run dir's group.log
            return subprocess.Popen(cmd, env=env)
        with (out / "group.log").open("a") as log:
            return subprocess.Popen(cmd, env=env, stdout=log, stderr=log)

    try:
        codes = supervise(start, procs, restarts, int(ft.max_restarts))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
        if lighthouse is not None:
            lighthouse.kill()
            lighthouse.wait()
        shutil.rmtree(barrier, ignore_errors=True)
    return group_summary(run_dir, codes, restarts)


def supervise(start: Callable[..., subprocess.Popen], procs: dict[int, subprocess.Popen], restarts: dict[int, int],
              max_restarts: int) -> dict[int, int]:
    """Start every group, restart one that fails (up to ``max_restarts`` each); their exit codes."""
    for g in restarts:
        procs[g] = start(g, first=True)
    codes: dict[int, int] = {}
    while len(codes) < len(restarts):
        time.sleep(POLL_S)
        for g, proc in procs.items():
            if g in codes or proc.poll() is None:
                continue
            if proc.returncode != 0 and restarts[g] < max_restarts:
                restarts[g] += 1
                print(f"fault tolerance: replica group {g} exited with {proc.returncode}; restart "
                      f"{restarts[g]}/{max_restarts}", flush=True)
                procs[g] = start(g)
            else:
                codes[g] = proc.returncode
    return codes


def group_summary(run_dir: str, codes: dict[int, int], restarts: dict[int, int]) -> dict[str, Any]:
    """Group 0's final loss (its metrics.jsonl), or RankFailed naming the groups that failed."""
    failed = {g: c for g, c in codes.items() if c != 0}
    if failed:
        raise RankFailed(f"replica group(s) {sorted(failed)} failed (exit {sorted(set(failed.values()))}); "
                         f"see {group_dir(run_dir, min(failed)) / 'group.log'} or the console above")
    metrics = Path(run_dir) / "metrics.jsonl"
    rows = [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r] if metrics.is_file() else []
    return {"final_loss": rows[-1]["loss"] if rows else None, "restarts": restarts}
