"""Save on SLURM's timeout / preemption signal, on every rank at the same step, then requeue.

Why not submitit's own hook alone: submitit binds ``SignalHandler.checkpoint_and_try_requeue``
to its preemption signal (USR2, sent ``cluster.signal_delay_s`` before the time limit, to every
task of the job) and acts only on global rank 0, *inside the signal handler*: it pickles the
job's ``checkpoint()`` resubmission, runs ``scontrol requeue`` and exits. A DCP save is a
collective; one rank cannot run it from a signal handler while the others keep training.

So each task's handler here only sets a flag. At every step boundary the ranks all-reduce the
flag (MAX over the world), so all of them stop after the same step even when the signal
reached them in different steps. They save that step together, then rank 0 hands over to
submitit's handler for the requeue (same resubmission pickle, same ``max_num_timeout``
accounting, same ``scontrol requeue``), and every rank leaves with ``JobRequeued`` (a
``SystemExit(0)``): submitit writes no result for a requeued attempt, so whoever waits on the
job keeps waiting for the requeued run, which resumes from the checkpoint in the same run dir.

A signal that arrives before the training loop starts is still handled by submitit alone
(requeue without a new save: the next run resumes from the latest checkpoint). Outside a
submitit SLURM job nothing is installed and the training loop is unchanged.

A hung run is requeued the same way (``requeue_on_hang``): the health watchdog's reporting rank,
whichever it is (the hung one may be rank 0), writes the same resubmission pickle and runs the
same ``scontrol requeue``, and the hang counts against ``cluster.max_requeue`` like a time limit
(a run that hangs in every attempt must end). No save: the ranks are stuck in a collective, so the
requeued job resumes from the last complete checkpoint.
"""

from __future__ import annotations

import signal
from typing import Any, Callable

import torch
import torch.distributed as dist


class JobRequeued(SystemExit):
    """Leave the task after a requeue; submitit's ``process_job`` lets SystemExit through
    (no result pickle), which is what marks the attempt as requeued rather than finished."""

    def __init__(self, message: str):
        super().__init__(0)
        self.message = message


def submitit_handler(signum: int) -> Any | None:
    """submitit's SLURM ``SignalHandler`` bound to ``signum`` in this process, if any."""
    bound = signal.getsignal(signum)
    handler = getattr(bound, "__self__", None)
    if type(handler).__name__ != "SignalHandler" or not hasattr(handler, "checkpoint_and_try_requeue"):
        return None
    return handler if getattr(handler.env, "cluster", None) == "slurm" else None


def submitit_signal() -> int:
    """The signal submitit asks SLURM for (``SUBMITIT_PREEMPT_SIGNAL``, USR2 by default)."""
    from submitit.core.job_environment import JobEnvironment

    return JobEnvironment._usr_sig()


class Preemption:
    """A per-rank signal flag, its agreement across ranks, and the one requeue.

    ``requeue_fn`` runs on rank 0 only and returns normally when the job was requeued (it may
    also end with SystemExit, as submitit's handler does); any other exception means no requeue.
    """

    def __init__(self, rank: int, world_size: int, device: torch.device, signum: int,
                 requeue_fn: Callable[[], None], log: Callable[[str], None] | None = None):
        self.rank, self.world_size = rank, world_size
        self.device = device
        self.signum = signum
        self.requeue_fn = requeue_fn
        self.log = log or (lambda msg: print(f"[preemption] {msg}", flush=True) if rank == 0 else None)
        self.signalled = False

    # ------------------------------------------------------------------ the flag
    def install(self) -> "Preemption":
        signal.signal(self.signum, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame: Any = None) -> None:
        self.signalled = True  # no I/O here: the handler may interrupt a print or a collective's setup

    # ------------------------------------------------------------------ agreement
    def should_stop(self) -> bool:
        """True on every rank once any rank was signalled (collective: all ranks call it each step)."""
        if self.world_size == 1 or not dist.is_initialized():
            return self.signalled
        flag = torch.tensor([1 if self.signalled else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    # ------------------------------------------------------------------ save + requeue
    def save_and_requeue(self, checkpointer, step: int) -> None:
        """Save ``step`` on all ranks, requeue once (rank 0), then leave. Never returns."""
        name = signal.Signals(self.signum).name
        self.log(f"{name} received: saving step {step} on all ranks, then requeueing")
        save_step(checkpointer, step)
        self.requeue(f"saved step {step}")

    def requeue(self, what: str) -> None:
        error: BaseException | None = None
        if self.rank == 0:
            try:
                self.requeue_fn()
            except SystemExit:  # submitit's handler exits after a successful `scontrol requeue`
                pass
            except Exception as e:  # noqa: BLE001  (no requeue: out of requeues, scontrol failed...)
                error = e
        ok = self._agree_rank0(error is None)
        if not ok:
            if error is not None:
                raise error
            raise RuntimeError("the job was not requeued (see rank 0's log)")
        self.log(f"job requeued after {what}; exiting this attempt")
        raise JobRequeued(f"requeued after {what}")

    def _agree_rank0(self, value: bool) -> bool:
        if self.world_size == 1 or not dist.is_initialized():
            return value
        flag = torch.tensor([1 if value else 0], dtype=torch.int32, device=self.device)
        dist.broadcast(flag, src=0)
        return bool(flag.item())


def save_step(checkpointer, step: int) -> None:
    """Make ``step`` a complete checkpoint: save it unless the interval save just did.

    Every rank takes the same decision from the same numbers (the save is a collective).
    """
    if checkpointer is None or not checkpointer.enabled:
        return  # nothing to save: the requeued job starts from its latest checkpoint, if any
    interval = checkpointer.interval
    if interval > 0 and step % interval == 0:
        checkpointer.wait()  # maybe_save started this step's save; finish and mark it
        return
    checkpointer.save(step, wait=True)


def requeue_now(handler: Any) -> str:
    """Requeue this submitit SLURM job from any of its tasks; what happened, as the end of a line."""
    from submitit.core.job_environment import _checkpoint

    job, countdown = handler.env.job_id, handler._delayed._timeout_countdown - 1
    if countdown < 0:
        return f"SLURM job {job} not requeued: its requeues are used up (cluster.max_requeue); the job ends"
    try:
        reason = _checkpoint(handler._delayed, handler._job_paths.submitted_pickle, countdown)
        if not reason:
            handler.env._requeue(countdown)  # scontrol requeue; SLURM then stops every task of this attempt
    except Exception as e:  # noqa: BLE001  (scontrol refused or timed out: the line says so, the job ends)
        reason = f"{type(e).__name__}: {e}"
    if reason:
        return f"SLURM job {job} not requeued ({reason}); the job ends"
    return (f"SLURM job {job} requeued ({countdown} more allowed by cluster.max_requeue); "
            "it resumes from its last checkpoint")


def requeue_on_hang() -> Callable[[], str] | None:
    """Inside a submitit SLURM job: what the hang watchdog calls to requeue the job; else None."""
    try:
        handler = submitit_handler(submitit_signal())
    except (ImportError, RuntimeError):
        return None
    return None if handler is None else (lambda: requeue_now(handler))


def watch_for_preemption(rank: int, world_size: int, device: torch.device) -> Preemption | None:
    """A Preemption with its handler installed when this task is part of a submitit SLURM job."""
    try:
        signum = submitit_signal()
    except (ImportError, RuntimeError):
        return None
    handler = submitit_handler(signum)
    if handler is None:
        return None
    return Preemption(rank, world_size, device, signum,
                      requeue_fn=lambda: handler.checkpoint_and_try_requeue(signum)).install()
