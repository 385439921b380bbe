"""Checkpoints across processes: exact resume under FSDP and TP, resharding, kill -9 recovery.

All runs share parity.BASE (fp32, full init, global batch 8) so that losses are comparable
across layouts; one FSDP run (2 ranks) is the reference and its checkpoints the source.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO
from parity import BASE, GLOBAL_BATCH, STEPS
from titan_hydra.checkpoint.storage import load_plain, read_metadata, tensor_entries

pytestmark = pytest.mark.slow
CKPT = ["checkpoint=default", "checkpoint.interval=3", "checkpoint.keep_latest_k=0", "training.deterministic=true"]
ATOL = 1e-5  # cross-layout loss tolerance (same as the parity tests)


def args_for(run_dir: Path, nproc: int, dp: int, extra: list[str]) -> list[str]:
    return [sys.executable, str(REPO / "launch.py"), *BASE, *CKPT, f"cluster.nproc_per_node={nproc}",
            f"training.local_batch_size={GLOBAL_BATCH // dp}", f"hydra.run.dir={run_dir}", *extra]


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}


def launch(run_dir: Path, nproc: int, dp: int, extra: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(args_for(run_dir, nproc, dp, extra), cwd=run_dir.parent, capture_output=True,
                          text=True, timeout=600, env=env())
    assert proc.returncode == 0, f"{extra} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def losses_by_step(run_dir: Path) -> dict[int, float]:
    """Last logged loss per step (a resumed run logs re-run steps again)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
        if "loss" in row:
            out[row["step"]] = row["loss"]
    return out


def model_of(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    path = run_dir / "checkpoint" / f"step-{step}"
    return load_plain(path, [k for k in tensor_entries(read_metadata(path)) if k.startswith("model.")])


def assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


FSDP = ["parallelism=fsdp"]
TP = ["parallelism=tp"]
PP = ["parallelism=pp", "parallelism.pp_microbatches=2"]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("fsdp") / "run"
    launch(run_dir, 2, 2, FSDP)
    return run_dir


def test_fsdp_kill9_recovery(fsdp_run, tmp_path):
    """kill -9 one worker after the first checkpoint: elastic restarts, resumes, same final state."""
    run_dir = tmp_path / "run"
    # The local launcher itself keeps restarted workers off the dead attempt's rendezvous store.
    restart_env = env()
    proc = subprocess.Popen(args_for(run_dir, 2, 2, FSDP + ["cluster.max_restarts=1"]), cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=restart_env)
    marker = run_dir / "checkpoint" / "step-3" / "COMPLETE.json"
    deadline = time.time() + 300
    while not marker.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    victim = _worker_pids(proc.pid)[-1]
    os.kill(victim, signal.SIGKILL)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-5000:]
    assert out.count("[checkpoint] loaded") == 1, out[-5000:]  # the restarted workers resumed
    assert losses_by_step(run_dir) == losses_by_step(fsdp_run)
    assert_bitwise(model_of(run_dir, STEPS), model_of(fsdp_run, STEPS))


def _worker_pids(parent: int) -> list[int]:
    """Spawned worker processes (children running multiprocessing's spawn_main) of ``parent``."""
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
    assert len(pids) == 2, pids
    return sorted(pids)


def test_reshard_fsdp_to_tp_and_tp_exact_resume(fsdp_run, tmp_path):
    """FSDP step-3 checkpoint -> TP (full state): losses continue; then TP resumes itself bitwise."""
    ref = losses_by_step(fsdp_run)
    tp_dir = tmp_path / "tp"
    src = fsdp_run / "checkpoint" / "step-3"
    launch(tp_dir, 2, 1, TP + [f"checkpoint.initial_load_path={src}", "checkpoint.initial_load_model_only=false"])
    tp = losses_by_step(tp_dir)
    assert sorted(tp) == list(range(4, STEPS + 1))
    assert max(abs(tp[s] - ref[s]) for s in tp) <= ATOL, (tp, ref)
    # Exact resume under TP: drop the later checkpoints, resume from TP's own step 6.
    again = tmp_path / "tp2"
    shutil.copytree(tp_dir / "checkpoint", again / "checkpoint")
    for step in (9, STEPS):
        shutil.rmtree(again / "checkpoint" / f"step-{step}")
    launch(again, 2, 1, TP)
    resumed = losses_by_step(again)
    assert sorted(resumed) == list(range(7, STEPS + 1))
    assert all(resumed[s] == tp[s] for s in resumed), (resumed, tp)
    assert_bitwise(model_of(again, STEPS), model_of(tp_dir, STEPS))


def test_reshard_fsdp_to_pp(fsdp_run, tmp_path):
    ref = losses_by_step(fsdp_run)
    src = fsdp_run / "checkpoint" / "step-3"
    launch(tmp_path / "pp", 2, 1, PP + [f"checkpoint.initial_load_path={src}", "checkpoint.initial_load_model_only=false"])
    pp = losses_by_step(tmp_path / "pp")
    assert sorted(pp) == list(range(4, STEPS + 1))
    assert max(abs(pp[s] - ref[s]) for s in pp) <= ATOL, (pp, ref)


def test_reshard_fsdp_to_single(fsdp_run, tmp_path):
    ref = losses_by_step(fsdp_run)
    src = fsdp_run / "checkpoint" / "step-3"
    launch(tmp_path / "single", 1, 1, ["parallelism=single", f"checkpoint.initial_load_path={src}",
                                       "checkpoint.initial_load_model_only=false"])
    single = losses_by_step(tmp_path / "single")
    assert sorted(single) == list(range(4, STEPS + 1))
    assert max(abs(single[s] - ref[s]) for s in single) <= ATOL, (single, ref)
