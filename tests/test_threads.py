"""Threads per process: every launcher divides this host's usable cores among the processes it
runs on it (torch elastic, torchrun, torchft replica groups, submitit's local jobs, SLURM tasks),
``cluster.threads_per_proc`` sets the count, OMP_NUM_THREADS only lowers it, and the run header
says how many each process uses and why (runtime/threads.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, run_launch
from titan_hydra.runtime.threads import LAUNCHES_ENV, exported, launches_env, threads_for, threads_here, usable_cores


# ----------------------------------------------------------------------------- the decision


@pytest.mark.parametrize("cores, processes, n, reason", [
    (2, 2, 1, "2 cores / 2 processes on this host"),
    (2, 1, 2, "2 cores / 1 process on this host"),
    (16, 3, 5, "16 cores / 3 processes on this host"),
    (2, 4, 1, "2 cores / 4 processes on this host"),  # never 0: one thread each, oversubscribed
    (1, 1, 1, "1 core / 1 process on this host"),
])
def test_equal_share_of_the_cores(cores, processes, n, reason):
    t = threads_for(cores, processes)
    assert (t.n, t.reason) == (n, reason)


def test_override_wins_and_omp_only_lowers():
    assert threads_for(2, 2, override=3) == threads_for(64, 1, override=3, cap=1)
    assert (threads_for(2, 2, override=3).n, threads_for(2, 2, override=3).reason) == (3, "cluster.threads_per_proc")
    low = threads_for(16, 2, cap=2)
    assert (low.n, low.reason) == (2, "OMP_NUM_THREADS=2; 16 cores / 2 processes on this host allow 8")
    assert threads_for(16, 2, cap=64).n == 8  # asking for more than the share does not oversubscribe


def test_slurm_task_gets_its_cpus():
    assert (threads_for(64, 8, slurm_cpus=8).n, threads_for(64, 8, slurm_cpus=8).reason) == (8, "8 CPUs per SLURM task")
    bound = threads_for(4, 8, slurm_cpus=8)  # bound to fewer cores than it was granted
    assert (bound.n, bound.reason) == (4, "8 CPUs per SLURM task, 4 usable")


# ----------------------------------------------------------------------------- what each launcher's process reads


SLURM_TASK = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_CPUS_PER_TASK": "8", "LOCAL_WORLD_SIZE": "8"}


@pytest.mark.parametrize("environ, local, n", [
    ({}, None, 16),                                           # one process
    ({"LOCAL_WORLD_SIZE": "4"}, None, 4),                     # a torchrun / torch elastic / submitit rank
    ({}, 4, 4),                                               # the local launcher, about to start 4 workers
    ({LAUNCHES_ENV: "2"}, None, 8),                           # one of 2 torchft groups (or local sweep jobs)
    ({LAUNCHES_ENV: "2", "LOCAL_WORLD_SIZE": "2"}, None, 4),  # a worker of a 2-rank group of 2 groups
    ({"LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}, None, 1),
    ({"LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": ""}, None, 8),  # empty: not set
    (SLURM_TASK, None, 8),                                    # a SLURM task that is a rank: its CPUs
    ({**SLURM_TASK, "TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "4"}, None, 4),  # a worker inside a step
    (SLURM_TASK, 2, 8),                                       # a task starting 2 workers shares the 16
])
def test_processes_on_this_host_from_the_environment(environ, local, n):
    assert threads_here(local_processes=local, environ=environ, cores=16).n == n


def test_nested_launches_multiply_and_exported_restores():
    assert launches_env(2, environ={LAUNCHES_ENV: "3"}) == {LAUNCHES_ENV: "6"}
    before = os.environ.get("OMP_NUM_THREADS")
    with exported({"OMP_NUM_THREADS": "7", LAUNCHES_ENV: "2"}):
        assert threads_here(cores=64).n == 7
    assert os.environ.get("OMP_NUM_THREADS") == before and LAUNCHES_ENV not in os.environ


# ----------------------------------------------------------------------------- every launcher, end to end

# Tiny runs with no thread setting: OMP_NUM_THREADS is dropped from their environment (the tests'
# one thread per process would hide the share) and cluster.threads_per_proc is left unset.
ARGS = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "training.seq_len=64", "training.steps=2",
        "training.local_batch_size=2", "training.mixed_precision=fp32", "training.val_freq=0",
        "lr_scheduler.warmup_steps=1", "data.max_documents=40", "logger=minimal"]
HEADER = re.compile(r"^  threads +(\d+) per process \((.*)\)$", re.M)


def reported(text: str) -> list[tuple[int, str]]:
    """(threads, reason) of every run header in ``text``."""
    return [(int(n), why) for n, why in HEADER.findall(text)]


def shared_by_two() -> tuple[int, str]:
    cores = usable_cores()
    return max(1, cores // 2), f"{cores} core{'s' if cores > 1 else ''} / 2 processes on this host"


def launch(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    proc = run_launch(args + ARGS, cwd=cwd, env=env, unset=["OMP_NUM_THREADS"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc



@pytest.mark.slow
def test_local_launcher_divides_the_cores(tmp_path):
    proc = launch(["cluster.nproc_per_node=2", "parallelism=ddp", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert reported(proc.stdout) == [shared_by_two()]


@pytest.mark.slow
@pytest.mark.extended
def test_torchrun_divides_the_cores(tmp_path):
    """LOCAL_WORLD_SIZE divides the cores even when OMP_NUM_THREADS asks for more (torchrun sets
    OMP_NUM_THREADS=1 only where it is unset)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO / "launch.py"), *ARGS, "parallelism=ddp"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "WANDB_SILENT": "true", "OMP_NUM_THREADS": "64"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert reported(proc.stdout) == [shared_by_two()]


@pytest.mark.slow
@pytest.mark.extended
def test_torchft_groups_divide_the_cores(tmp_path):
    """The finding: each of 2 replica groups ran with every core's threads (4 threads on 2 cores)."""
    run_dir = tmp_path / "run"
    proc = launch(["fault_tolerance=torchft", "fault_tolerance.replica_groups=2", f"hydra.run.dir={run_dir}"],
                  tmp_path)
    group1 = (run_dir / "replica_groups" / "1" / "group.log").read_text()
    assert reported(proc.stdout) == reported(group1) == [shared_by_two()]


@pytest.mark.slow
@pytest.mark.extended
def test_submitit_local_jobs_divide_the_cores(tmp_path):
    """The jobs of a local sweep run at once: 2 jobs of one process each share the cores."""
    sweep = tmp_path / "sweep"
    launch(["-m", "hydra/launcher=submitit_local", "optimizer.lr=1e-3,3e-3", f"hydra.sweep.dir={sweep}"], tmp_path)
    logs = sorted(sweep.rglob("*_log.out"))
    assert len(logs) == 2, logs
    assert [reported(log.read_text()) for log in logs] == [[shared_by_two()]] * 2


@pytest.mark.slow
@pytest.mark.extended
def test_threads_per_proc_overrides(tmp_path):
    proc = launch(["cluster.nproc_per_node=2", "parallelism=ddp", "cluster.threads_per_proc=3",
                   f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert reported(proc.stdout) == [(3, "cluster.threads_per_proc")]
