"""One run per run dir: an exclusive lock that a crashed run cannot leave behind.

Two processes training into the same ``hydra.run.dir`` (a job resubmitted while the first still
runs, a typo'd sweep dir) would write the same checkpoints and metrics. The process that owns
the run takes ``fcntl.flock`` on ``<run_dir>/.titan_hydra.lock`` and writes its pid, host and
start time there for the error message; the kernel drops the lock when that process exits, however
it exits (kill -9 included), so a crash never leaves the dir stuck, and a SLURM requeue (a new
process after the old one ended) takes it again.

Who owns the run: the single process, the local launcher's parent (its torch-elastic workers do
not lock), rank 0 under torchrun or inside a SLURM job; not the process that only submits a
SLURM job and waits for it. On a file system without flock (some parallel file systems) the
run goes on unlocked, with one warning.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

from titan_hydra.errors import UserError

log = logging.getLogger("titan_hydra")
LOCK_NAME = ".titan_hydra.lock"


class RunDirLock:
    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> "RunDirLock":
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise UserError(
                f"run dir {self.path.parent} is in use by another run ({holder}); wait for it to end "
                "or set another hydra.run.dir"
            ) from None
        except OSError as e:  # no flock on this file system
            os.close(fd)
            log.warning("cannot lock run dir %s (%s); continuing without a lock", self.path.parent, e)
            return self
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            import fcntl

            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunDirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"pid {info['pid']} on {info['host']}, started {info['started']}"
    except (ValueError, KeyError, OSError):
        return "holder unknown"


def owns_run(submits_to_slurm: bool) -> bool:
    """Whether this process is the one that holds the run dir's lock (see module docstring)."""
    if submits_to_slurm or os.environ.get("TITAN_HYDRA_WORKER"):
        return False
    return int(os.environ.get("RANK", "0")) == 0
