"""Faults during a run: a rank killed, the disk full while saving, a shard corrupted at rest.

What must hold every time: the run stops with one ``error:`` line (no traceback) and a non-zero
exit, within a bounded time; the newest complete checkpoint is intact, passes its recorded sizes
and checksums, and loads; nothing half-written is ever taken for complete.

The kill tests start a 2-rank pipeline-parallel and a 2-rank tensor-parallel run (both at once:
most of a launch is single-threaded start-up) and SIGKILL one worker once the step-2 checkpoint
is complete. ENOSPC is injected into DCP's file writer: through ``launch.py`` for a synchronous
save (in a subprocess whose writer is patched before launch.py runs) and in this process for an
asynchronous one.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from titan_hydra.spec import spec_of
from helpers import BASE, GLOBAL_BATCH, REPO, TINY, by_step, compose_cfg
from test_bad_inputs import manager
from titan_hydra.checkpoint import CheckpointError, latest_complete, list_steps, read_marker
from titan_hydra.checkpoint.storage import load_plain, read_metadata, tensor_entries, verify_files

KILL_AFTER = 2  # the checkpoint step whose completion triggers the kill
STOP_WITHIN_S = 30.0  # the launcher must have stopped every rank and exited by then


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def assert_one_line(proc_stderr: str, returncode: int) -> str:
    """The run's report: non-zero exit, no traceback, exactly one ``error:`` line and it is the last line."""
    lines = [line for line in proc_stderr.splitlines() if line.strip()]
    assert returncode not in (0, None), proc_stderr[-3000:]
    assert "Traceback" not in proc_stderr, proc_stderr[-3000:]
    errors = error_lines(proc_stderr)
    assert len(errors) == 1 and lines[-1] == errors[0], proc_stderr[-3000:]
    return errors[0]


def assert_loadable(step_path: Path) -> int:
    """Every recorded file matches its size and CRC-32, and every tensor entry loads; returns the entry count."""
    marker = read_marker(step_path)
    assert marker is not None and marker.get("files"), step_path
    verify_files(step_path, marker)
    keys = list(tensor_entries(read_metadata(step_path)))
    loaded = load_plain(step_path, keys)
    assert all(torch.isfinite(v.float()).all() for k, v in loaded.items() if k.startswith("model.")), step_path
    return len(loaded)


# ----------------------------------------------------------------------------- a rank killed

LAYOUTS = {
    "pp": ["parallelism=pp", "model.tie_word_embeddings=false"],
    "tp": ["parallelism=tp"],
}


def _worker_pids(parent: int) -> list[int]:
    """The launcher's spawned worker processes (children running multiprocessing's spawn_main)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (entry / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and "spawn_main" in cmd and "resource_tracker" not in cmd:
            pids.append(int(entry.name))
    return sorted(pids)


def _kill_run(run_dir: Path, layout: str) -> dict:
    """Launch 2 ranks saving every 2 steps; SIGKILL one worker once step-2 is complete."""
    run_dir.mkdir(parents=True)
    args = [sys.executable, str(REPO / "launch.py"), *BASE, *LAYOUTS[layout], "training.steps=200",
            "checkpoint=default", "checkpoint.interval=2", "cluster.nproc_per_node=2",
            "cluster.start_method=spawn",  # the default users run; workers are found by their spawn_main command line
            f"training.local_batch_size={GLOBAL_BATCH}", f"hydra.run.dir={run_dir}"]
    marker = run_dir / "checkpoint" / f"step-{KILL_AFTER}" / "COMPLETE.json"
    err_log = run_dir.parent / f"{layout}.err"  # files, not pipes: nobody reads them while we wait
    with open(err_log, "w") as err, open(run_dir.parent / f"{layout}.out", "w") as out:
        proc = subprocess.Popen(args, cwd=run_dir.parent, stdout=out, stderr=err, text=True, env=env())
        try:
            deadline, pids = time.time() + 300, []
            while time.time() < deadline and proc.poll() is None and not (len(pids) == 2 and marker.exists()):
                pids = pids if len(pids) == 2 else _worker_pids(proc.pid)
                time.sleep(0.01)
            assert len(pids) == 2 and marker.exists(), \
                f"{layout}: no workers or no {marker} (rc={proc.poll()})\n{err_log.read_text()[-3000:]}"
            victim = pids[-1]
            os.kill(victim, signal.SIGKILL)
            killed_at = time.time()
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{layout}: launcher still running 120 s after the kill\n"
                                     f"{err_log.read_text()[-3000:]}") from None
            stopped_after = time.time() - killed_at
        finally:
            if proc.poll() is None:
                proc.kill()
    survivors = [p for p in pids if Path(f"/proc/{p}").exists() and "spawn_main" in
                 Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")]
    return {"rc": proc.returncode, "stderr": err_log.read_text(), "victim": victim, "stopped_after": stopped_after,
            "survivors": survivors}


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    base = tmp_path_factory.mktemp("killed")
    with ThreadPoolExecutor(len(LAYOUTS)) as pool:
        futures = {name: pool.submit(_kill_run, base / name / "run", name) for name in LAYOUTS}
        return {name: (base / name / "run", f.result()) for name, f in futures.items()}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_rank_killed_stops_the_run_in_one_line_and_keeps_the_last_checkpoint(layout, killed, record_property):
    run_dir, result = killed[layout]
    record_property(f"{layout} seconds from kill to launcher exit", round(result["stopped_after"], 2))
    line = assert_one_line(result["stderr"], result["rc"])
    assert re.fullmatch(rf"error: rank [01] \(pid {result['victim']}\) was killed by SIGKILL; the other ranks were "
                        r"stopped .*resume from its newest complete checkpoint\)", line), line
    assert result["stopped_after"] < STOP_WITHIN_S, result["stopped_after"]
    assert result["survivors"] == [], result["survivors"]  # no orphaned rank left running
    best, newer_incomplete = latest_complete(run_dir / "checkpoint")
    assert best is not None and best.step >= KILL_AFTER, list_steps(run_dir / "checkpoint")
    for step in list_steps(run_dir / "checkpoint"):  # every dir with a marker is whole; others are never chosen
        if step.complete:
            assert_loadable(step.path)
        else:
            assert step.step > best.step, step
    assert assert_loadable(best.path) > 0


# ----------------------------------------------------------------------------- disk full while saving

# Runs launch.py in a process whose DCP writer raises ENOSPC (after writing a few bytes) for every
# file of the step-4 save: the first write error a full disk gives.
ENOSPC_LAUNCH = """
import errno, runpy, sys
import torch.distributed.checkpoint.filesystem as fs
real = fs._write_item
def full_disk(*args, **kwargs):
    stream = args[1] if len(args) > 1 else kwargs.get("stream")
    if "step-4" in str(getattr(stream, "name", "")):
        stream.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")
    return real(*args, **kwargs)
fs._write_item = full_disk
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

ENOSPC_RUN = TINY + ["logger=minimal", "checkpoint=default", "checkpoint.interval=2", "training.val_freq=0",
                     "cluster.threads_per_proc=1", "training.steps=6"]


@pytest.mark.slow
def test_enospc_while_saving_keeps_the_previous_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", ENOSPC_LAUNCH, str(REPO / "launch.py"), *ENOSPC_RUN,
                           f"hydra.run.dir={run_dir}"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=env())
    line = assert_one_line(proc.stderr, proc.returncode)
    folder = run_dir / "checkpoint"
    assert line == (f"error: saving checkpoint step 4 to {folder / 'step-4'} failed (rank 0: [Errno {errno.ENOSPC}] "
                    f"No space left on device); the newest complete checkpoint {folder / 'step-2'} is intact"), line
    assert [(s.step, s.complete) for s in list_steps(folder)] == [(2, True)]  # the failed save left nothing
    assert assert_loadable(folder / "step-2") > 0

    # The same run dir, disk space back: the run resumes from step 2 and finishes.
    from titan_hydra.train.pretrain import run

    run(spec_of(compose_cfg(ENOSPC_RUN)), str(run_dir))
    losses = by_step(run_dir, "loss")
    assert sorted(losses) == [1, 2, 3, 4, 5, 6], losses  # steps 3..6 after the resume; 1..4 logged before
    assert [s.step for s in list_steps(folder) if s.complete][-1] == 6


def test_enospc_in_an_async_save_is_reported_at_the_next_wait(tmp_path, monkeypatch):
    import torch.distributed.checkpoint.filesystem as fs

    m = manager(tmp_path, async_mode="async")
    first = m.save(1, wait=True)
    real = fs._write_item

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fs, "_write_item", full_disk)
    m.save(2)  # background save: returns before anything is written
    with pytest.raises(CheckpointError) as info:
        m.wait()
    monkeypatch.setattr(fs, "_write_item", real)
    assert re.fullmatch(rf"saving checkpoint step 2 to .*/step-2 failed \(.*No space left on device\); "
                        rf"the newest complete checkpoint {re.escape(str(first))} is intact", str(info.value)), info.value
    assert [(s.step, s.complete) for s in list_steps(m.folder)] == [(1, True)]
    assert assert_loadable(first) > 0
    m.close()


# ----------------------------------------------------------------------------- corruption at rest


def test_marker_records_every_file_and_old_markers_still_load(tmp_path):
    """The marker lists each file with its real size and CRC-32; a marker from before checksums
    (no ``files``) still loads."""
    import zlib

    m = manager(tmp_path)
    path = m.save(1, wait=True)
    recorded = read_marker(path)["files"]
    on_disk = sorted(f.name for f in path.iterdir() if f.name != "COMPLETE.json")
    assert sorted(recorded) == on_disk and ".metadata" in recorded
    for name, info in recorded.items():
        data = (path / name).read_bytes()
        assert info == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}, name

    old = json.loads((path / "COMPLETE.json").read_text())
    old.pop("files")
    (path / "COMPLETE.json").write_text(json.dumps(old))
    again = manager(tmp_path / "again")
    again.load(path)
    ref = {k: v for k, v in m.model_parts[0].state_dict().items()}
    assert all(torch.equal(v, ref[k]) for k, v in again.model_parts[0].state_dict().items())
