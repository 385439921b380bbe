"""Checkpoints across processes: exact resume, resharding, async saves, kill -9 recovery, seeds under PP.

A launch costs ~10-30 s here, mostly process start-up, so the module starts each run once
(the ``runs`` fixture) and runs up to two launches at a time; every test only reads results.
One synchronous FSDP run (2 ranks, checkpoints every 2 steps) is the reference and the source
of the reshard tests; the kill -9 run uses ``checkpoint=async``, so the same run shows that async
checkpoints are tensor-identical to sync ones and that a resume from one continues bit for bit.
All runs share helpers.BASE (fp32, full init, global batch 8), so losses compare across layouts.
Single-process runs (seed creation, seed reference, reshard to one process) run in this process:
they need no launcher and start much faster.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from titan_hydra.spec import spec_of
from helpers import BASE, GLOBAL_BATCH, REPO, by_step, compose_cfg, launch_here, parity_bound, read_metrics
from titan_hydra.checkpoint.storage import load_plain, read_metadata, tensor_entries

STEPS = 6
SRC = 2  # the FSDP checkpoint that the reshard tests start from
CKPT = ["checkpoint=default", "checkpoint.interval=2", "checkpoint.keep_latest_k=0", "training.deterministic=true",
        f"training.steps={STEPS}"]
# Cross-layout losses are held to what rounding alone moves the same model's 10-step curve by on
# this machine (helpers.parity_bound; these runs take 6 steps of it).
SEED_STEPS = 3  # "first losses" compared for seed checkpoints
SEED_RUN = ["checkpoint=none", "training.deterministic=true", f"training.steps={SEED_STEPS}"]


def overrides_for(nproc: int, dp: int, extra: list[str], ckpt: list[str] = CKPT) -> list[str]:
    return [*BASE, *ckpt, f"cluster.nproc_per_node={nproc}", f"training.local_batch_size={GLOBAL_BATCH // dp}", *extra]


def args_for(run_dir: Path, nproc: int, dp: int, extra: list[str], ckpt: list[str] = CKPT) -> list[str]:
    return [sys.executable, str(REPO / "launch.py"), *overrides_for(nproc, dp, extra, ckpt), f"hydra.run.dir={run_dir}"]


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}


def launch(run_dir: Path, nproc: int, dp: int, extra: list[str], ckpt: list[str] = CKPT) -> None:
    launch_here(overrides_for(nproc, dp, extra, ckpt), run_dir)


def run_here(run_dir: Path, extra: list[str], ckpt: list[str] = SEED_RUN) -> None:
    """One process, in this process (pretrain.run): the same program as a launched rank."""
    from titan_hydra.train.pretrain import run

    cfg = compose_cfg([*BASE, *ckpt, "cluster.nproc_per_node=1", "parallelism=single",
                       f"training.local_batch_size={GLOBAL_BATCH}", *extra])
    run_dir.mkdir(parents=True, exist_ok=True)
    run(spec_of(cfg), str(run_dir))


def entries_of(run_dir: Path, step: int, prefixes: tuple[str, ...] = ("model.",)) -> dict[str, torch.Tensor]:
    path = run_dir / "checkpoint" / f"step-{step}"
    return load_plain(path, [k for k in tensor_entries(read_metadata(path)) if k.startswith(prefixes)])


def assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k}: max diff {(a[k].float() - b[k].float()).abs().max().item()}"


def max_diff(a: dict[int, float], b: dict[int, float]) -> float:
    return max(abs(a[s] - b[s]) for s in a)


FSDP = ["parallelism=fsdp"]
TP = ["parallelism=tp"]
# ZBVZeroBubble: rank 0 holds the first and the last stage (embeddings + norm/output), so loading
# the full state (optimizer included) goes through PartsView with two stages on one rank.
PP_V = ["parallelism=pp", "parallelism.pp_schedule=ZBVZeroBubble"]
SEED_SCHEDULES = ("1F1B", "Interleaved1F1B")  # one stage per rank; two stages per rank
# Launches that may run at once. Most of a launch is single-threaded start-up and teardown, so two
# at a time on 2 cores cut the module's wall time by about a third (measured 43 s vs 64 s for two).
PARALLEL = int(os.environ.get("TITAN_HYDRA_TEST_PARALLEL", "2"))


def _from(src: Path) -> list[str]:
    return [f"checkpoint.initial_load_path={src}", "checkpoint.initial_load_model_only=false"]


@pytest.fixture(scope="module")
def seeded(tmp_path_factory) -> dict[str, Path]:
    """The single-process seed runs, in this process: a seed checkpoint made from training.seed=7
    (nothing trained), a run that loads it, and the same run without it (initialized from 42)."""
    base = tmp_path_factory.mktemp("seeded")
    d = {name: base / name for name in ("seed", "seed_single", "unseeded")}
    run_here(d["seed"], ["checkpoint=default", "checkpoint.create_seed_checkpoint=true", "training.seed=7"])
    run_here(d["seed_single"], [f"checkpoint.initial_load_path={d['seed'] / 'checkpoint'}"])
    run_here(d["unseeded"], [])
    return d


@pytest.fixture(scope="module")
def runs(tmp_path_factory, seeded):
    """Every launched run of this module, started once and concurrently; tests read the futures.

    Subprocess launches go to a pool of PARALLEL threads, submitted in dependency order (a job
    only waits for jobs submitted before it, which have all started: no deadlock). Runs in this
    process change torch's global state (seed, threads), so they get their own one-thread pool.
    """
    base = tmp_path_factory.mktemp("layouts")
    d = {name: base / name for name in ("fsdp", "kill9", "tp", "tp2", "pp_v", "single")}
    src = d["fsdp"] / "checkpoint" / f"step-{SRC}"
    pool, here = ThreadPoolExecutor(PARALLEL), ThreadPoolExecutor(1)
    f: dict[str, Future] = {}
    f["fsdp"] = pool.submit(launch, d["fsdp"], 2, 2, FSDP)
    f["kill9"] = pool.submit(_kill9_run, d["kill9"])
    f["tp"] = pool.submit(_after, [f["fsdp"]], launch, d["tp"], 2, 1, TP + _from(src))
    f["pp_v"] = pool.submit(_after, [f["fsdp"]], launch, d["pp_v"], 2, 1, PP_V + _from(src))
    f["single"] = here.submit(_after, [f["fsdp"]], run_here, d["single"], _from(src), CKPT)
    for s in SEED_SCHEDULES:
        d[s] = base / f"seed_{s}"
        f[s] = pool.submit(launch, d[s], 2, 1, ["parallelism=pp", f"parallelism.pp_schedule={s}",
                                                f"checkpoint.initial_load_path={seeded['seed'] / 'checkpoint'}"],
                           SEED_RUN)
    f["tp2"] = pool.submit(_after, [f["tp"]], _tp_resume, d["tp"], d["tp2"])
    yield d, f
    pool.shutdown(wait=True, cancel_futures=False)
    here.shutdown(wait=True)


def _after(deps: list[Future], fn, *args):
    for dep in deps:
        dep.result()
    return fn(*args)


def result(runs, name: str) -> Path:
    d, f = runs
    f[name].result()
    return d[name]


def _tp_resume(tp_dir: Path, again: Path) -> None:
    """Copy TP's checkpoints without the last one and resume from TP's own step 4."""
    shutil.copytree(tp_dir / "checkpoint", again / "checkpoint")
    shutil.rmtree(again / "checkpoint" / f"step-{STEPS}")
    launch(again, 2, 1, TP)


def _kill9_run(run_dir: Path) -> str:
    """checkpoint=async on FSDP(2), saving every step; kill -9 one worker once step 1 is complete."""
    run_dir.mkdir(parents=True)
    # spawn (the default users run): the test finds the worker to kill by its spawn_main command line
    extra = FSDP + ["checkpoint=async", "checkpoint.interval=1", "cluster.max_restarts=1", "cluster.start_method=spawn"]
    log = run_dir.parent / "kill9.out"  # a file, not a pipe: nobody reads while the test waits to kill
    with open(log, "w") as sink:
        proc = subprocess.Popen(args_for(run_dir, 2, 2, extra), cwd=run_dir.parent, stdout=sink,
                                stderr=subprocess.STDOUT, text=True, env=env())
        try:
            _kill_one_worker_after(proc, run_dir / "checkpoint" / "step-1" / "COMPLETE.json")
            proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
    out = log.read_text()
    assert proc.returncode == 0, out[-5000:]
    return out


# --------------------------------------------------------------------------- async + kill -9


@pytest.mark.slow
def test_async_fsdp_kill9_recovery(runs):
    """Async checkpoints under FSDP(2) equal sync ones; kill -9 + elastic restart resumes exactly.

    The restarted workers resume from an async checkpoint; the losses and the checkpoints at
    steps 2 and 4 (async) and 6 (the last save, sync) must equal the synchronous run's bit for
    bit, model and optimizer state.
    """
    d, f = runs
    out = f["kill9"].result()
    fsdp_run, run_dir = result(runs, "fsdp"), d["kill9"]
    loads = re.findall(r"\[checkpoint\] loaded \S+/step-(\d+) ", out)
    assert len(loads) == 1 and 1 <= int(loads[0]) < STEPS, out[-5000:]  # resumed mid-run, from an async save
    ref = by_step(fsdp_run, "loss")
    got = by_step(run_dir, "loss")
    assert got == ref, (got, ref)
    for step in (2, 4, STEPS):
        assert_bitwise(entries_of(run_dir, step, ("model.", "optim.")), entries_of(fsdp_run, step, ("model.", "optim.")))


def _kill_one_worker_after(proc: subprocess.Popen, marker: Path) -> None:
    """Freeze both workers the moment ``marker`` appears, SIGKILL one, let the other go on."""
    deadline = time.time() + 300
    pids: list[int] = []
    while time.time() < deadline and proc.poll() is None:
        pids = pids if len(pids) == 2 else _worker_pids(proc.pid)
        if len(pids) == 2 and marker.exists():
            break
        time.sleep(0.01)
    assert len(pids) == 2 and marker.exists(), f"no workers or no {marker} (run ended: rc={proc.poll()})"
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    os.kill(pids[-1], signal.SIGKILL)
    os.kill(pids[0], signal.SIGCONT)


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
    return sorted(pids)


# --------------------------------------------------------------------------- resharding


@pytest.mark.slow
def test_reshard_fsdp_to_tp_and_tp_exact_resume(runs, run_cache):
    """FSDP step-2 checkpoint -> TP (full state): losses continue; then TP resumes itself bitwise."""
    ref = by_step(result(runs, "fsdp"), "loss")
    tp_dir = result(runs, "tp")
    tp = by_step(tp_dir, "loss")
    assert sorted(tp) == list(range(SRC + 1, STEPS + 1))
    assert max_diff(tp, ref) <= parity_bound(run_cache), (tp, ref)
    again = result(runs, "tp2")
    resumed = by_step(again, "loss")
    assert sorted(resumed) == list(range(5, STEPS + 1))
    assert all(resumed[s] == tp[s] for s in resumed), (resumed, tp)
    assert_bitwise(entries_of(again, STEPS), entries_of(tp_dir, STEPS))


@pytest.mark.parametrize("name", ["pp_v", "single"])
@pytest.mark.slow
def test_reshard_fsdp(name, runs, run_cache):
    """FSDP step-2 full state -> PP with two stages per rank (V placement) / one process."""
    ref = by_step(result(runs, "fsdp"), "loss")
    got = by_step(result(runs, name), "loss")
    assert sorted(got) == list(range(SRC + 1, STEPS + 1))
    assert max_diff(got, ref) <= parity_bound(run_cache), (got, ref)


# --------------------------------------------------------------------------- seed checkpoints


def test_seed_checkpoint_trains_nothing_and_loads_in_one_process(seeded):
    """The seed is made from training.seed=7; the runs themselves initialize from 42, so a load
    that silently did nothing shows up as a loss mismatch."""
    assert by_step(read_metrics(seeded["seed"], missing_ok=True), "loss") == {}  # the seed run trains nothing
    single = by_step(seeded["seed_single"], "loss")
    assert sorted(single) == list(range(1, SEED_STEPS + 1))
    assert abs(single[1] - by_step(seeded["unseeded"], "loss")[1]) > 1e-3


@pytest.mark.parametrize("schedule", SEED_SCHEDULES)
@pytest.mark.slow
def test_seed_checkpoint_under_pp(schedule, seeded, runs, run_cache):
    """A seed checkpoint made by one process loads into each rank's stage(s) under PP.

    The seed is made from training.seed=7; the runs themselves initialize from 42 (what the FSDP
    run started from), so a load that silently did nothing shows up as a loss mismatch.
    """
    assert by_step(read_metrics(seeded["seed"], missing_ok=True), "loss") == {}  # the seed run trains nothing
    single = by_step(seeded["seed_single"], "loss")
    assert abs(single[1] - by_step(result(runs, "fsdp"), "loss")[1]) > 1e-3
    pp = by_step(result(runs, schedule), "loss")
    assert sorted(pp) == list(range(1, SEED_STEPS + 1))
    assert max_diff(pp, single) <= parity_bound(run_cache), (pp, single)
