"""Local multi-process launcher: torch elastic workers on this machine.

``python launch.py cluster.nproc_per_node=4`` lands here. The parent has already composed and
validated the config and chosen the run dir; it prepares the dataset cache once (so bad records
fail here, with one line, and workers don't all tokenize at once), then starts the workers
through torch elastic's launcher API with a c10d rendezvous on a free local port. Elastic
restarts (``cluster.max_restarts``) re-run the workers with the same config and run dir, which
is what lets a restarted run find its checkpoint.

A worker that fails on bad input (a UserError) is reported by the parent as that UserError,
so ``launch.py`` prints one ``error: ...`` line and exits non-zero, as a single process would.
``torchrun --standalone --nproc-per-node N launch.py ...`` bypasses this module: every rank
composes the same config, shares the run dir through TORCHELASTIC_RUN_ID (config.run_dir.run_subdir)
and runs the recipe in-rank (launch/entry.py).
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import signal
import uuid
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from titan_hydra.config import ClusterConfig
from titan_hydra.errors import RankFailed, UserError
from titan_hydra.metrics.goodput import LAUNCH_STARTED_ENV, launch_ended, launch_started
from titan_hydra.runtime.rendezvous import free_port
from titan_hydra.runtime.threads import exported, threads_here
from titan_hydra.spec import RunSpec
from titan_hydra.train.health.watchdog import HANG_EXIT_CODE
from titan_hydra.train.services import build_dataset


# The per-rank program the workers run, as "module:function" (a string pickles to any start
# method; tests and other recipes point it elsewhere).
DEFAULT_PROGRAM = "titan_hydra.train.pretrain:run"
PROGRAM_MODULE = __name__  # worker_main's module: what every worker imports first
GC_PAUSED_MODULE = "titan_hydra.launch.gc_paused"  # the fork server imports it before everything


class WorkerUserError(UserError):
    """A UserError raised inside a worker; its type name marks it in the elastic error file."""


def load_program(spec: str):
    import importlib

    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


@record
def worker_main(spec: RunSpec, run_dir: str, return_state: bool = False, program: str = DEFAULT_PROGRAM,
                launched_at: float | None = None):
    """Entry point of one elastic worker (module level so that spawn can pickle it): runs
    ``program`` on the run's spec, which the launcher validated once for every worker.
    ``launched_at``: when the launcher's start-up began, for the run's goodput ledger (an argument,
    not the environment: a fork server keeps the environment it started with, an earlier launch's).

    A UserError is re-raised as WorkerUserError so that the parent can tell bad input (one
    line, no traceback) from a bug (traceback kept in the error file).
    """
    os.environ["TITAN_HYDRA_WORKER"] = "1"
    if launched_at is not None:
        os.environ[LAUNCH_STARTED_ENV] = repr(launched_at)
    gc.freeze()  # what a forked worker inherited lives as long as it does (launch/gc_paused.py)
    gc.enable()
    # A forked worker keeps the launcher's thread count (OMP_NUM_THREADS is read once, at import)
    # and Hydra's logging (console format, the launcher's log file): make it a fresh worker's.
    torch.set_num_threads(threads_here(spec.cluster.threads_per_proc).n)  # its share (LOCAL_WORLD_SIZE)
    if str(spec.cluster.start_method) == "fork":
        for handler in list(logging.root.handlers):
            logging.root.removeHandler(handler)
        logging.root.setLevel(logging.WARNING)
    try:
        return load_program(program)(spec, run_dir, return_state=return_state)
    except UserError as e:
        raise WorkerUserError(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__) from e
    finally:
        gc.freeze()  # a spawned worker's exit skips the final walk over every object (see launch.py)


def run_local(
    spec: RunSpec, run_dir: str, return_state: bool = False, program: str | None = None
) -> dict[str, Any]:
    """Run all ranks of this node; returns rank 0's summary.

    A worker's UserError comes back as UserError (the caller prints one ``error:`` line);
    any other worker failure raises RuntimeError naming the rank and its error file.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    cluster = spec.cluster
    if int(cluster.nnodes) != 1:
        raise UserError(
            f"cluster.nnodes={cluster.nnodes} needs a multi-node launcher; use a slurm cluster "
            "or start each node with torchrun"
        )
    # Forked workers inherit the tokenizer's thread pool state; this keeps HF tokenizers from
    # warning about it in every worker (they tokenize little: the cache below did the work).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if str(cluster.start_method) == "forkserver":
        # The server imports the program once (a clean, single-threaded process) and forks
        # every worker from it: one import per launch instead of one per rank. torch._dynamo too,
        # which every rank would import when it first makes a tensor on the meta device, and the
        # model family's own (transformers' for model=hf). Started now, it imports while this
        # process prepares the data. (A server already running, from an earlier launch of this
        # process, keeps the imports it started with: the rest happen in the ranks, as before.)
        multiprocessing.set_forkserver_preload([GC_PAUSED_MODULE, PROGRAM_MODULE,
                                                (program or DEFAULT_PROGRAM).partition(":")[0], "torch._dynamo",
                                                *spec.family.worker_imports])
        from multiprocessing import forkserver

        forkserver.ensure_running()
    build_dataset(spec.data)  # fills the token cache; bad data fails here, before any worker starts
    _quiet_join_tracebacks()
    entry = elastic_launch(launch_config_of(cluster), worker_main)
    # torch elastic hands the workers this process's OMP_NUM_THREADS: make it their share of the cores
    threads = threads_here(cluster.threads_per_proc, local_processes=int(cluster.nproc_per_node))
    try:
        with exported({"OMP_NUM_THREADS": str(threads.n)}):
            results = entry(spec, run_dir, return_state, program or DEFAULT_PROGRAM, launch_started())
    except ChildFailedError as e:
        raise error_of(e) from None
    finally:
        launch_ended()
    return results[0]


def launch_config_of(cluster: ClusterConfig):
    """One node, c10d rendezvous on a free local port, spawned workers."""
    from torch.distributed.launcher.api import LaunchConfig

    if int(cluster.max_restarts) > 0:
        # Restarted workers must not reuse the dead attempt's rendezvous store: its stale gloo
        # addresses make init_process_group fail with "connectFullMesh ... Connection refused".
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    port = cluster.master_port or free_port()
    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=int(cluster.nproc_per_node),
        run_id=f"titan-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{port}",
        rdzv_configs={"timeout": 120},
        max_restarts=int(cluster.max_restarts),
        monitor_interval=0.2,
        start_method=str(cluster.start_method),
    )


def _message_of(failure) -> str:
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", str(message))
    return str(message or "").strip()


class _DropTraceback(logging.Filter):
    """torch elastic logs its own join() traceback when a worker fails: it says nothing about the
    worker (whose traceback is in its error file), so the log line stays and the traceback goes."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info, record.exc_text = None, None
        return True


def _quiet_join_tracebacks() -> None:
    log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    if not any(isinstance(f, _DropTraceback) for f in log.filters):
        log.addFilter(_DropTraceback())


def error_of(e) -> Exception:
    """UserError if any rank failed on bad input (others then die as a consequence), else RuntimeError."""
    marker = f"{WorkerUserError.__name__}: "
    for rank, failure in sorted(e.failures.items()):
        message = _message_of(failure)
        if message.startswith(marker):
            return UserError(message[len(marker):].splitlines()[0])
    rank, failure = e.get_first_failure()
    if failure.exitcode is not None and failure.exitcode < 0:  # killed by a signal: no Python error to show
        try:
            name = signal.Signals(-failure.exitcode).name
        except ValueError:
            name = f"signal {-failure.exitcode}"
        return RankFailed(
            f"rank {rank} (pid {failure.pid}) was killed by {name}; the other ranks were stopped "
            "(run again with the same hydra.run.dir to resume from its newest complete checkpoint)"
        )
    if failure.exitcode == HANG_EXIT_CODE:  # the health watchdog already printed which rank stopped first
        return RankFailed(f"rank {rank} was ended by the hang watchdog (exit {HANG_EXIT_CODE}; stacks in the run "
                          "dir's hang/); run again with the same hydra.run.dir, or set cluster.max_restarts, "
                          "to resume from its newest complete checkpoint")
    message = _message_of(failure)
    last = message.splitlines()[-1] if message else f"exit code {failure.exitcode}"
    return RuntimeError(f"rank {rank} failed: {last} (see {failure.error_file} for its traceback)")
