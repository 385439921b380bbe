"""The ``health`` group under fsdp(2), through launch.py: a NaN that only one rank sees is
skipped by both ranks, a slow rank is named, a hung rank ends the run with both ranks' stacks and
the launcher's restart finishes it from the last checkpoint with the final checkpoint of a run
that never hung, bit for bit, a gradient bit flip on one rank is found by the recheck and named
on both."""

from __future__ import annotations

import json
import time

import pytest

from helpers import BASE, FSDP2, STEPS, assert_same_checkpoint, by_step, fsdp2_reference, run_launch
from titan_hydra.train.health.monitor import HealthMonitor
from titan_hydra.config.fault_injection import FaultInjection
from titan_hydra.config.health import Health

RUN = [a for a in BASE if not a.startswith("training.steps=")] + FSDP2  # each test sets its steps


def launch(tmp_path, name: str, overrides: list[str], timeout: int = 300):
    run_dir = tmp_path / name
    proc = run_launch(RUN + [f"hydra.run.dir={run_dir}", *overrides], cwd=tmp_path, timeout=timeout)
    return proc, run_dir


def rank_reports(run_dir) -> list[dict]:
    return [json.loads((run_dir / "health" / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_the_rank_reports_are_written_where_the_tests_read_them(tmp_path):
    """Each rank writes its counts on close (read above), also without a process group."""
    class State:
        step = 7

    monitor = HealthMonitor(Health(hang_timeout_s=0), FaultInjection(), run_dir=str(tmp_path), rank=1, world_size=1,
                            device=None, parts=[], checkpointer=None, loader=None, state=State(),
                            metric_logger=None)
    monitor.close()
    report = json.loads((tmp_path / "health" / "rank1.json").read_text())
    assert (report["step"], report["skipped"], report["rollbacks"], report["event_lines"]) == (7, 0, 0, [])


@pytest.mark.slow
@pytest.mark.extended
def test_a_nan_on_one_rank_is_skipped_by_both_and_the_slow_rank_is_named(tmp_path):
    proc, run_dir = launch(tmp_path, "drill", [
        "training.steps=4", "fault_injection.nan_at_step=2", "fault_injection.fault_rank=1",
        "fault_injection.slow_rank=1", "fault_injection.delay_s=0.3",
        "health.straggler_every=2", "health.straggler_ratio=1.2"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "  FAULTS" in proc.stdout and "!!! FAULT INJECTION ON (a drill, not a real run): NaN at step 2 on rank 1" in proc.stdout
    assert proc.stdout.count("health: step 2 non-finite: loss is nan, grad_norm is nan; skipped") == 1
    # the same decision on both ranks, though only rank 1 computed a NaN
    assert [(r["skipped"], r["step"]) for r in rank_reports(run_dir)] == [(1, 4), (1, 4)]
    assert by_step(run_dir, "health/skipped") == {2: 1}
    assert by_step(run_dir, "health/slowest_rank") == {2: 1.0, 4: 1.0}
    assert "health: straggler: rank 1 (" in proc.stdout
    assert len(by_step(run_dir, "loss")) == 4


@pytest.mark.slow
@pytest.mark.extended
def test_a_hung_rank_ends_the_attempt_and_the_restart_finishes_the_run(tmp_path, run_cache):
    timeout_s = 8
    started = time.monotonic()
    proc, run_dir = launch(tmp_path, "hang", [
        f"training.steps={STEPS}", "checkpoint=default", "checkpoint.interval=1", "cluster.max_restarts=1",
        "fault_injection.hang_rank=1", "fault_injection.hang_at_step=2", f"health.hang_timeout_s={timeout_s}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert out.count("hang: rank 1 (") == 1 and "stopped first, in step 1 (done)" in out
    assert out.count("exiting 75 so the run restarts from its last checkpoint") == 1
    stacks = {r: (run_dir / "hang" / f"rank{r}.stacks.txt").read_text() for r in (0, 1)}
    assert "inject.py" in stacks[1] and "begin_step" in stacks[1]  # the hung rank's own frame
    assert "inject.py" not in stacks[0]  # rank 0 waits in the step's collective
    report = json.loads((run_dir / "hang" / "rank1.json").read_text())
    assert report["flight_recorder"] == "flight recorder flight_recorder.rank1.json"
    assert "resuming at step 1" in out and [r["step"] for r in rank_reports(run_dir)] == [STEPS, STEPS]
    assert time.monotonic() - started < 240
    # bit for bit the run that never hung: every step's loss and the whole last checkpoint
    clean_dir, _ = fsdp2_reference(run_cache)
    assert by_step(run_dir, "loss") == by_step(clean_dir, "loss")
    assert_same_checkpoint(run_dir, clean_dir, STEPS)


@pytest.mark.slow
@pytest.mark.extended
def test_a_flipped_weight_bit_on_one_replica_stops_the_run_naming_it(tmp_path):
    proc, run_dir = launch(tmp_path, "bitflip", [
        "training.steps=4", "parallelism=ddp", "fault_injection.bitflip_rank=1", "fault_injection.at_step=2",
        "health.checksum_every=1"])
    assert proc.returncode != 0
    assert "silent corruption at step 2: rank(s) [0, 1] hold weights that differ from their replicas' " \
           "(first: tok_embeddings.weight)" in proc.stderr
    assert by_step(run_dir, "health/replicas_differ") == {1: 0.0}  # step 1 compared equal


@pytest.mark.slow
@pytest.mark.extended
def test_a_gradient_bit_flip_on_one_rank_is_found_by_the_recheck_and_named(tmp_path):
    proc, run_dir = launch(tmp_path, "recheck", [
        "training.steps=4", "health.recheck_every=2", "health.recheck_action=continue",
        "fault_injection.bitflip_rank=1", "fault_injection.at_step=2", "fault_injection.bitflip_target=grad"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("health: step 2 recheck: the same batch gave other gradients on rank 1 (transient); "
                             "continuing with the agreeing gradients") == 1
    assert [r["recheck_mismatches"] for r in rank_reports(run_dir)] == [1, 1]  # both ranks decided alike
    assert by_step(run_dir, "health/recheck_mismatch") == {2: 1.0, 4: 0.0}
