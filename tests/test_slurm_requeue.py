"""Save-on-signal and requeue (titan_hydra.runtime.preemption).

Unit (2 local gloo ranks, seconds): a signal that reaches one rank only stops both ranks after
the same step; both save that step once; the requeue runs once, on rank 0; every rank leaves
with exit code 0; a failed requeue fails every rank instead.

(c) against the real local SLURM (scripts/slurm): a 2-task gloo FSDP job with a 2-minute limit
meets two faults, one per attempt: SLURM's USR2 ``cluster.signal_delay_s`` (60 s) before the limit
(the first attempt saves and is requeued), then a hang (the second attempt's rank 1 stops at its
first step, the watchdog of every rank fires after 4 s and rank 0 requeues the job with the hang
line). sacct lists two REQUEUED attempts; the third resumes from the saved step in the same run
dir and ends with per-step losses equal, bit for bit, to an uninterrupted local run of the same
config (the session's shared fsdp(2) reference), and its goodput ledger counts the three attempts,
two restarts and the steps trained twice.

Why the first attempt waits in the test: the job must still be training when SLURM signals it
(~60 s into the attempt: the limit minus the delay; SLURM may send it earlier by up to its
timer period, so the delay cannot be raised to save time), but an uninterrupted reference run
of that many real steps would multiply the test's time. So the test submits a subclass of the product's
``RankTask`` whose *first* attempt, after ``WAIT_AT_STEP`` steps, waits until a rank has the
signal (a condition, not a timer: the signal's time varies with SLURM's timer passes), telling
the hang watchdog that waiting is not hanging; its ``checkpoint()`` is the product's, which
resubmits a plain ``RankTask`` - the requeued attempts are the product code as is, at full
speed. Waiting changes no number (losses don't depend on time).
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from submitit.helpers import DelayedSubmission

from helpers import (BASE, GLOBAL_BATCH, STEPS, assert_same_checkpoint, by_step, compose_cfg, fsdp2_reference,
                     read_metrics, spawn_gloo)
from slurm_fixtures import slurm  # noqa: F401  (the session fixture)
from titan_hydra.launch.submitit_jobs import error_line
from titan_hydra.metrics.goodput import LEDGER, read_records, tally_of
from titan_hydra.runtime.preemption import (JobRequeued, Preemption, requeue_now, requeue_on_hang, save_step,
                                           watch_for_preemption)

# ---------------------------------------------------------------- unit: agreement on 2 local ranks

SIGNAL_STEP = 3


class FakeCheckpointer:
    enabled = True
    interval = 500

    def __init__(self):
        self.saved: list[int] = []

    def save(self, step, wait=False):
        self.saved.append(step)

    def wait(self):
        pass


def _agreement_worker(rank: int, out_dir: str, fail_requeue: bool) -> None:
    requeues = Path(out_dir) / f"requeue_calls.{rank}"

    def requeue_fn():
        with open(requeues, "a") as f:
            f.write("1")
        if fail_requeue:
            raise RuntimeError("scontrol requeue refused")

    previous = signal.getsignal(signal.SIGUSR2)
    pre = Preemption(rank, 2, torch.device("cpu"), signal.SIGUSR2, requeue_fn, log=lambda m: None).install()
    ckpt = FakeCheckpointer()
    result = {"rank": rank, "stopped_at": None, "exit": None, "error": None}
    try:
        for step in range(1, 11):
            if rank == 1 and step == SIGNAL_STEP:
                os.kill(os.getpid(), signal.SIGUSR2)  # only rank 1 hears it, in the middle of a step
            x = torch.ones(4) * step
            dist.all_reduce(x)  # the step's own collective
            if pre.should_stop():
                result["stopped_at"] = step
                pre.save_and_requeue(ckpt, step)
        result["stopped_at"] = None
    except JobRequeued as e:
        result["exit"] = e.code
    except RuntimeError as e:
        result["error"] = str(e)
    finally:
        signal.signal(signal.SIGUSR2, previous)
        result["saved"] = ckpt.saved
        result["signalled"] = pre.signalled
        (Path(out_dir) / f"result.{rank}.json").write_text(json.dumps(result))


def _run_agreement(tmp_path: Path, fail_requeue: bool) -> list[dict]:
    spawn_gloo(_agreement_worker, 2, str(tmp_path), fail_requeue)
    results = [json.loads((tmp_path / f"result.{r}.json").read_text()) for r in range(2)]
    calls = sum(len((tmp_path / f"requeue_calls.{r}").read_text()) for r in range(2)
                if (tmp_path / f"requeue_calls.{r}").exists())
    return results, calls


@pytest.mark.slow
def test_signal_on_one_rank_stops_both_at_the_same_step(tmp_path):
    results, calls = _run_agreement(tmp_path, fail_requeue=False)
    assert [r["signalled"] for r in results] == [False, True]  # the signal reached rank 1 only
    assert [r["stopped_at"] for r in results] == [SIGNAL_STEP, SIGNAL_STEP]
    assert [r["saved"] for r in results] == [[SIGNAL_STEP], [SIGNAL_STEP]]  # one collective save
    assert calls == 1 and (tmp_path / "requeue_calls.0").exists()  # requeued once, by rank 0
    assert [r["exit"] for r in results] == [0, 0]  # both leave with exit code 0


@pytest.mark.slow
def test_failed_requeue_fails_every_rank(tmp_path):
    results, calls = _run_agreement(tmp_path, fail_requeue=True)
    assert [r["stopped_at"] for r in results] == [SIGNAL_STEP, SIGNAL_STEP]
    assert calls == 1
    assert [r["exit"] for r in results] == [None, None]
    assert results[0]["error"] == "scontrol requeue refused"
    assert "not requeued" in results[1]["error"]


def test_interval_save_is_not_repeated():
    ckpt = FakeCheckpointer()
    ckpt.interval = 5
    save_step(ckpt, 10)  # maybe_save already saved step 10
    save_step(ckpt, 12)
    assert ckpt.saved == [12]


def test_nothing_is_installed_outside_slurm():
    before = signal.getsignal(signal.SIGUSR2)
    assert watch_for_preemption(0, 1, torch.device("cpu")) is None
    assert signal.getsignal(signal.SIGUSR2) is before
    assert requeue_on_hang() is None  # the hang watchdog leaves the restart to the launcher


class Resubmitted:
    """A job function with submitit's ``checkpoint()`` hook, as RankTask."""

    def __call__(self):
        return 0

    def checkpoint(self):
        return DelayedSubmission(Resubmitted())


def submitit_handler_of(tmp_path: Path, requeues_left: int, requeue) -> SimpleNamespace:
    """What ``requeue_now`` reads of submitit's SignalHandler: the job, its pickle, the requeue call."""
    delayed = DelayedSubmission(Resubmitted())
    delayed.set_timeout(2, requeues_left)
    return SimpleNamespace(env=SimpleNamespace(job_id="12", _requeue=requeue), _delayed=delayed,
                           _job_paths=SimpleNamespace(submitted_pickle=tmp_path / "12_submitted.pkl"))


def test_a_hang_requeues_the_job_within_max_requeue(tmp_path):
    requeued = []
    line = requeue_now(submitit_handler_of(tmp_path, 1, requeued.append))
    assert line == "SLURM job 12 requeued (0 more allowed by cluster.max_requeue); it resumes from its last checkpoint"
    resubmitted = DelayedSubmission.load(tmp_path / "12_submitted.pkl")  # what the requeued job runs
    assert requeued == [0] and resubmitted._timeout_countdown == 0 and isinstance(resubmitted.function, Resubmitted)
    assert requeue_now(submitit_handler_of(tmp_path, 0, requeued.append)) == (
        "SLURM job 12 not requeued: its requeues are used up (cluster.max_requeue); the job ends")

    def refused(countdown):
        raise subprocess.CalledProcessError(1, ["scontrol", "requeue", "12"])

    line = requeue_now(submitit_handler_of(tmp_path, 2, refused))
    assert requeued == [0] and line.startswith("SLURM job 12 not requeued (CalledProcessError: Command ")
    # a job that ends on a hang it could not requeue: its hang line is what the submitting process reports
    log = f"step     5 | loss 7.9\nhang: rank 1 (vm) stopped first; {line}\nsrun: error: vm: task 0: Exited with exit code 75"
    assert error_line(log) == f"hang: rank 1 (vm) stopped first; {line}"


# ---------------------------------------------------------------- (c) a real SLURM time limit, then a hang

WAIT_AT_STEP = 4  # the first attempt trains this many steps, then waits for the signal
# The first attempt stops at step WAIT_AT_STEP + 1 at the latest (the step after its wait), so
# only the requeued attempt reaches this step (and only it: the next finds the hang reports).
HANG_AT_STEP = WAIT_AT_STEP + 2
HANG_TIMEOUT_S = 4
SIGNAL_WAIT_S = 300  # past the job's 2-minute limit: a signal that never comes fails the test there
WAITING = "waiting_for_the_signal"  # the first attempt's marker: from then on the machine is idle
CONFIG = BASE + ["parallelism=fsdp", f"training.local_batch_size={GLOBAL_BATCH // 2}", "checkpoint=default"]
FAULTS = ["fault_injection.hang_rank=1", f"fault_injection.hang_at_step={HANG_AT_STEP}",
          f"health.hang_timeout_s={HANG_TIMEOUT_S}"]


def signal_waiting_first_attempt_task():
    """A RankTask subclass (built here so that cloudpickle ships it by value to the job).

    Each rank polls its own preemption flag and a marker file in the run dir (a rank that has the
    signal writes it), so every rank moves on as soon as one has it; the next step boundary's
    agreement then stops them all at the same step."""
    from titan_hydra.launch.slurm import RankTask

    class SignalWaitingFirstAttempt(RankTask):
        def __call__(self):
            from titan_hydra.train.trainer import Trainer

            step = Trainer.train_step
            marker = Path(self.run_dir) / "signal_seen"

            def step_after_the_signal(trainer):
                if trainer.state.step >= WAIT_AT_STEP and trainer.preemption is not None:
                    (Path(self.run_dir) / WAITING).touch()
                    deadline = time.monotonic() + SIGNAL_WAIT_S
                    while not marker.exists() and time.monotonic() < deadline:
                        if trainer.preemption.signalled:
                            marker.touch()
                        trainer.health.watchdog.beat(trainer.state.step, "done")  # waiting, not hung
                        time.sleep(0.05)
                return step(trainer)

            Trainer.train_step = step_after_the_signal
            return super().__call__()

    return SignalWaitingFirstAttempt


def sacct_states(job_id: str, timeout_s: float = 60) -> list[str]:
    """States of every attempt of the job, once the last one is final in accounting (which
    lags the result file that submitit waits for by a few seconds)."""
    deadline = time.time() + timeout_s
    while True:
        out = subprocess.run(["sacct", "-n", "-X", "--duplicates", "-j", job_id, "-o", "State%20"],
                             capture_output=True, text=True, timeout=60).stdout
        states = [s.strip() for s in out.splitlines() if s.strip()]
        if (states and states[-1] not in ("RUNNING", "COMPLETING", "PENDING")) or time.time() > deadline:
            return states
        time.sleep(2)


@pytest.mark.slow
def test_time_limit_signal_then_hang_requeue_and_resume_exactly(slurm, tmp_path, monkeypatch, capsys, run_cache,
                                                                record_property):
    from titan_hydra.launch import slurm as slurm_launch
    from titan_hydra.validate import validate

    run_dir = tmp_path / "slurm_run"
    cfg = compose_cfg(CONFIG + FAULTS + ["cluster=slurm_local", "cluster.tasks_per_node=2", "cluster.timeout_min=2",
                                         "cluster.signal_delay_s=60", "cluster.max_requeue=2"])
    validate(cfg)
    monkeypatch.setattr(slurm_launch, "RankTask", signal_waiting_first_attempt_task())
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("WANDB_SILENT", "true")
    t0 = time.time()
    with ThreadPoolExecutor(1) as pool:  # the clean run trains while the job waits for its signal
        job = pool.submit(slurm_launch.submit, cfg, str(run_dir))
        deadline = time.monotonic() + SIGNAL_WAIT_S
        while not (run_dir / WAITING).exists() and not job.done() and time.monotonic() < deadline:
            time.sleep(0.2)  # not before: the first attempt must be training when the signal comes
        clean_dir, _ = fsdp2_reference(run_cache)
        summary = job.result()
    slurm_s = time.time() - t0
    job_id = capsys.readouterr().out.split("submitted SLURM job ")[1].split(";")[0]

    states = sacct_states(job_id)
    logs = run_dir / ".submitit" / job_id
    log, err = ((logs / f"{job_id}_0_log.{x}").read_text() for x in ("out", "err"))
    assert states[-1] == "COMPLETED" and states.count("REQUEUED") == 2, (
        f"{states}\n" + "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(logs.glob("*_log.*"))))
    resumed = [int(line.rsplit("resuming at step ", 1)[1].split()[0]) for line in log.splitlines()
               if "resuming at step" in line]
    assert len(resumed) == 2 and resumed[0] == resumed[1], log[-3000:]  # the hung attempt saved nothing
    k = resumed[0]
    assert 0 < k < HANG_AT_STEP, log[-3000:]
    assert (run_dir / "checkpoint" / f"step-{k}").is_dir()
    # the hang: one line from rank 0 (the hung rank is 1), the job requeued with the last requeue allowed
    hang = [line for line in err.splitlines() if line.startswith("hang: ")]
    assert len(hang) == 1 and hang[0].startswith("hang: rank 1 (")
    assert f"stopped first, in step {HANG_AT_STEP - 1} (done)" in hang[0], hang[0]
    assert hang[0].endswith(f"SLURM job {job_id} requeued (0 more allowed by cluster.max_requeue); "
                            "it resumes from its last checkpoint"), hang[0]
    assert "inject.py" in (run_dir / "hang" / "rank1.stacks.txt").read_text()

    local = by_step(clean_dir, "loss")
    logged = by_step(run_dir, "loss")  # every attempt appended: the last attempt's rows win
    carried = [float(x) for x in summary["losses"]]  # TrainState: steps 1..k came through the checkpoint
    assert sorted(local) == sorted(logged) == list(range(1, STEPS + 1)) and len(carried) == STEPS
    diff_logged = max(abs(logged[s] - local[s]) for s in local)
    diff_carried = max(abs(carried[s - 1] - local[s]) for s in local)
    for name, value in (("resumed at step", k), ("SLURM job seconds", round(slurm_s)),
                        ("max |logged - local|", diff_logged), ("max |carried - local|", diff_carried)):
        record_property(name, value)
    assert diff_logged == 0 and diff_carried == 0, (  # the same config and layout: bit for bit
        f"resumed at step {k}: max |slurm - local| over {STEPS} steps: logged {diff_logged:.3g}, "
        f"carried {diff_carried:.3g} (not bit for bit)")
    assert_same_checkpoint(run_dir, clean_dir, STEPS)
    # The goodput ledger went on across both requeues: three attempts, two of them restarts, the
    # steps trained twice those metrics.jsonl got from two attempts, the restarts' start-up lost.
    records, problem = read_records(run_dir / LEDGER)
    assert problem is None, problem
    tally = tally_of(records)
    rows = collections.Counter(r["step"] for r in read_metrics(run_dir) if "loss" in r)
    twice = sorted(step for step, n in rows.items() if n > 1)
    assert len(tally.attempts) == 3 and tally.restarts == 2, tally.attempts
    assert tally.lost_steps == len(twice) and all(step > k for step in twice), (tally.lost_steps, twice, k)
    assert tally.totals["lost"] > 0 and tally.totals["productive"] > 0
    last = [r for r in read_metrics(run_dir) if "goodput/restarts" in r][-1]
    assert last["step"] == STEPS and last["goodput/restarts"] == 2 and last["goodput/lost_steps"] == len(twice)
    record_property("goodput of the requeued job", round(tally.goodput, 3))
