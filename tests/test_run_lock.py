"""One run per run dir: a second run into a busy run dir stops with one line; a killed run's lock
does not outlive it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import TINY, run_launch
from titan_hydra.errors import UserError
from titan_hydra.launch.run_lock import RunDirLock


def test_second_lock_on_a_busy_run_dir_names_the_holder(tmp_path):
    with RunDirLock(tmp_path):
        with pytest.raises(UserError, match=rf"run dir {tmp_path} is in use by another run \(pid {os.getpid()} on "):
            RunDirLock(tmp_path).acquire()
    RunDirLock(tmp_path).acquire().release()  # free again once released


@pytest.mark.slow
def test_launch_into_a_busy_run_dir_is_refused_before_training(tmp_path):
    run_dir = tmp_path / "run"
    with RunDirLock(run_dir):
        proc = run_launch(TINY + ["training.steps=2", f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: run dir {run_dir} is in use by another run (pid")
    assert not (run_dir / "metrics.jsonl").exists()


@pytest.mark.slow
def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    code = ("import sys, time; from titan_hydra.launch.run_lock import RunDirLock; "
            f"RunDirLock({str(tmp_path)!r}).acquire(); print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match=f"pid {holder.pid} "):
            RunDirLock(tmp_path).acquire()
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        deadline = time.monotonic() + 10
        while True:  # the kernel drops the lock with the process
            try:
                RunDirLock(tmp_path).acquire().release()
                break
            except UserError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
    finally:
        holder.kill()
