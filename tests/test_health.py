"""The ``health`` group on one process: the skip decision's numbers, a skipped step that leaves
weights, optimizer and schedule bit-equal, equal to a run whose data skipped that batch, a
rollback past the bad data window, and the gradient recheck that finds an injected bit flip
(see test_health_ranks.py for 2 ranks)."""

from __future__ import annotations

import copy
import json
import math
import re
import sys
import threading

import pytest
import torch

from helpers import REPO, TINY, compose_cfg, read_metrics
from titan_hydra.errors import ConfigError, TrainingDiverged
from titan_hydra.spec import spec_of
from titan_hydra.train.health.guard import SpikeWindow, StepGuard
from titan_hydra.train.health.monitor import HealthMonitor
from titan_hydra.train.health.recheck import GradRecheck
from titan_hydra.train.health.sdc import SilentCorruption
from titan_hydra.config.fault_injection import FaultInjection
from titan_hydra.config.health import Health
from titan_hydra.train.health.watchdog import DECISION, Watchdog, attempt_id, hang_line
from titan_hydra.train.pretrain import run
from titan_hydra.train.services import health_of

FAST = TINY + ["logger=minimal", "training.val_freq=0", "cluster.threads_per_proc=1",
               "training.mixed_precision=fp32", "training.steps=4"]


def guard(action: str = "skip") -> StepGuard:
    return StepGuard(skip_nonfinite=True, spike_window=8, spike_min_history=4, spike_k=5.0, spike_action=action)


def test_threshold_is_median_plus_k_mad():
    w = SpikeWindow(size=5, min_history=3, k=2.0)
    for v in (1.0, 2.0):
        w.add(v)
    assert w.threshold() == math.inf  # fewer than min_history values: nothing is a spike yet
    for v in (3.0, 10.0, 4.0, 5.0):  # the window keeps the last 5: 2, 3, 10, 4, 5
        w.add(v)
    # median 4, deviations 2 1 6 0 1 -> MAD 1
    assert w.threshold() == 4.0 + 2.0 * 1.0


def test_nonfinite_steps_are_skipped_and_counted_in_a_row():
    g = guard()
    assert not g.judge(float("nan"), 1.0).apply
    v = g.judge(2.0, float("inf"))
    assert (v.apply, v.reason, g.skipped, g.in_a_row) == (False, "non-finite", 2, 2)
    assert g.judge(2.0, 1.0).apply and g.in_a_row == 0 and g.skipped == 2


@pytest.mark.parametrize("action, applied", [("skip", False), ("log", True)])
def test_a_spike_is_judged_on_healthy_history_only(action, applied):
    g = guard(action)
    for loss in (3.0, 3.1, 2.9, 3.0, 3.05):
        assert g.judge(loss, 1.0).apply
    v = g.judge(30.0, 1.0)
    assert (v.apply, v.reason, g.spikes) == (applied, "spike", 1)
    assert 30.0 not in g.windows["loss"].values  # a spike never raises its own threshold
    assert g.judge(3.0, 50.0).reason == "spike"  # the gradient norm is judged the same way


def test_bad_settings_name_the_key():
    for bad, message in ((dict(spike_k=-1), "health.spike_k=-1 must be > 0"),
                         (dict(hang_timeout_s=-1), "health.hang_timeout_s=-1 must be >= 0"),
                         (dict(straggler_ratio=0.5), "health.straggler_ratio=0.5 must be >= 1")):
        with pytest.raises(ConfigError, match=re.escape(message)) as err:
            Health(**bad)  # each rule alone: the others keep their defaults
        assert "\n" not in str(err.value) and "," not in str(err.value).split(":")[0]
    with pytest.raises(ConfigError, match=r"fault_injection\.slow_rank=5 is not a rank of this run \(world size 2\)"):
        FaultInjection(slow_rank=5).check_ranks(2)
    FaultInjection(slow_rank=1, hang_rank=1, bitflip_rank=1).check_ranks(2)
    with pytest.raises(ConfigError, match="health.spike_action='drop'"):
        Health(spike_action="drop")
    with pytest.raises(ConfigError, match="health.spike_min_history=30 exceeds health.spike_window=20"):
        Health(spike_window=20, spike_min_history=30)
    with pytest.raises(ConfigError, match="fault_injection.delay_s=-1"):
        FaultInjection(delay_s=-1)
    with pytest.raises(ConfigError, match="health.recheck_action='log' is not one of stop, continue"):
        Health(recheck_action="log")
    with pytest.raises(ConfigError, match="fault_injection.bitflip_target='act' is not one of weight, grad"):
        FaultInjection(bitflip_target="act")


def test_the_header_lines_state_the_cost_and_shout_when_faults_are_on():
    assert "no extra collective per step" in Health().describe()
    assert Health(enable=False).describe().startswith("off")
    assert "no gradient recheck" in Health().describe()
    assert "gradients recomputed and compared every 100 steps" in Health(recheck_every=100).describe()
    assert FaultInjection(bitflip_rank=1, at_step=4, bitflip_target="grad").describe().endswith(
        "rank 1 flips a gradient bit in the recheck of step 4")
    faults = FaultInjection(nan_at_step=5, slow_rank=1, delay_s=0.2)
    assert not FaultInjection().enabled and faults.enabled
    assert faults.describe() == ("!!! FAULT INJECTION ON (a drill, not a real run): NaN at step 5 on rank 0; "
                                 "rank 1 0.2 s slower every step")


def test_the_hang_line_names_the_rank_that_stopped_first(tmp_path):
    reports = {0: {"rank": 0, "host": "a", "step": 3, "phase": "forward/backward", "last_beat_unix": 10.0},
               1: {"rank": 1, "host": "b", "step": 2, "phase": "done", "last_beat_unix": 9.9}}
    line = hang_line(reports, 5.0, tmp_path, world_size=3)
    assert line.startswith("hang: rank 1 (b) stopped first, in step 2 (done); no progress for 5 s")
    assert "(no report from rank(s) [2])" in line and line.endswith("exiting 75 so the run restarts from its last checkpoint")


def test_only_this_attempts_hang_reports_count(tmp_path, monkeypatch, capsys):
    """Ranks 0 and 1 of attempt 1 fire (threads here; ``_report`` without the exit): rank 0 alone
    restarts the run and prints the line with what ``restart`` did; attempt 0's report of rank 2
    and its decision, left in the same dir, are neither named nor taken for this attempt's."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "titan-1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    old = attempt_id()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    hang = tmp_path / "hang"
    hang.mkdir()
    (hang / "rank2.json").write_text(json.dumps({"rank": 2, "host": "old", "step": 1, "phase": "done",
                                                 "last_beat_unix": 1.0, "attempt": old}))
    (hang / DECISION).write_text(json.dumps({"attempt": old, "rank": 2, "line": "hang: ..."}))
    restarts = []
    dogs = [Watchdog(1.0, str(tmp_path), r, 3, restart=lambda r=r: restarts.append(r) or "requeued (test)")
            for r in (0, 1)]
    dogs[0].beat(3, "forward/backward")
    dogs[1].beat(2, "done")
    assert not dogs[1]._read(DECISION)  # attempt 0's decision does not release rank 1
    rank1 = threading.Thread(target=dogs[1]._report)
    rank1.start()
    dogs[0]._report()
    rank1.join(timeout=30)
    assert not rank1.is_alive() and restarts == [0]
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hang: rank 1 (") and "in step 2 (done)" in lines[0]
    assert lines[0].endswith("(no report from rank(s) [2]); requeued (test)")
    assert json.loads((hang / DECISION).read_text())["line"] == lines[0]


def test_the_composed_groups_default_to_on_and_off():
    cfg = compose_cfg()
    assert cfg.health.enable and cfg.health.spike_action == "log" and cfg.fault_injection.nan_at_step is None
    strict = compose_cfg(["health=strict"]).health
    assert (strict.spike_action, strict.max_skips_in_a_row, strict.hang_timeout_s) == ("skip", 3, 600.0)
    assert not compose_cfg(["health=off"]).health.enable


# ----------------------------------------------------------------------------- in-process runs


def train(tmp_path, overrides, name):
    return run(spec_of(compose_cfg(FAST + overrides)), str(tmp_path / name), return_state=True)


def snapshot(monitor: HealthMonitor) -> dict:
    run_parts = monitor.rollback.checkpointer.run
    return copy.deepcopy({"model": [p.state_dict() for p in run_parts.model_parts],
                          "optimizer": run_parts.optimizer.state_dict(),
                          "schedule": run_parts.lr_scheduler.state_dict()})


def assert_bit_equal(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_bit_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_bit_equal(x, y)
    else:
        assert a == b


def test_a_skipped_nan_step_changes_nothing_and_equals_skipping_its_batch(tmp_path, monkeypatch):
    """Step 3 sees a NaN: the state before its retry is bit-equal to the state before it, and the
    run ends bit-equal to a fault-free run whose loader skipped that batch."""
    begin = HealthMonitor.begin_step
    seen: dict[int, list] = {}

    def spying(self, step):
        seen.setdefault(step, []).append(snapshot(self))
        begin(self, step)

    monkeypatch.setattr(HealthMonitor, "begin_step", spying)
    faulty = train(tmp_path, ["fault_injection.nan_at_step=3"], "nan")
    assert len(seen[3]) == 2 and len(seen[4]) == 1  # step 3 tried twice
    assert_bit_equal(seen[3][0], seen[3][1])
    rows = [r for r in read_metrics(tmp_path / "nan") if "health/skipped" in r]
    assert [(r["step"], r["health/skipped"]) for r in rows] == [(3, 1)]
    assert faulty["health"]["skipped"] == 1 and faulty["steps"] == 4

    def skip_batch(self, step):  # the fault-free run whose data skipped the 3rd batch
        if step == 3 and not getattr(self, "_skipped_batch", False):
            self._skipped_batch = True
            next(self.rollback.loader)
        begin(self, step)

    monkeypatch.setattr(HealthMonitor, "begin_step", skip_batch)
    clean = train(tmp_path, [], "clean")
    assert faulty["losses"] == clean["losses"]
    assert_bit_equal(faulty["full_state"], clean["full_state"])


def test_skips_in_a_row_roll_back_past_the_bad_data_then_stop(tmp_path):
    rollback = ["checkpoint=default", "checkpoint.interval=2", "health.max_skips_in_a_row=2",
                "fault_injection.nan_at_step=3", "fault_injection.nan_attempts=2"]
    out = train(tmp_path, rollback, "rollback")
    assert out["steps"] == 4 and out["health"]["rollbacks"] == 1 and out["health"]["skipped"] == 2
    [record] = [json.loads(line) for line in (tmp_path / "rollback/health/skipped_data.jsonl").read_text().splitlines()]
    # global batch 4: the checkpoint of step 2 sits at sample 8; two failed tries of step 3 read 8 more
    assert record == {"rollback": 1, "failed_step": 3, "to_step": 2, "data_from": 8, "data_to": 16,
                      "why": "non-finite: loss is nan, grad_norm is nan"}
    with pytest.raises(TrainingDiverged, match=r"^loss is nan, grad_norm is nan at step 3: 2 steps in a row skipped .* after 0 "
                                               r"rollback\(s\) \(health.max_rollbacks=0\); the run stops"):
        train(tmp_path, rollback + ["health.max_rollbacks=0"], "stop")


def test_health_off_stops_at_the_first_nan_as_before(tmp_path):
    with pytest.raises(TrainingDiverged, match=r"^loss is nan at step 2; lower optimizer.lr"):
        train(tmp_path, ["health=off", "fault_injection.nan_at_step=2"], "off")


def test_the_benchmark_times_the_monitor_alone():
    sys.path.insert(0, str(REPO / "recipes"))
    import bench_health

    per_step = bench_health.monitor_alone(50)
    assert 0 < per_step < 0.01  # microseconds in fact; 10 ms would be 1% of a debug-model step


def test_the_sweep_report_counts_skipped_steps_and_rollbacks(tmp_path):
    from titan_hydra.analysis import sweep as jobs

    rows = [{"step": s, "loss": 7.0 - s} for s in range(1, 5)]
    rows += [{"step": 2, "health/skipped": 1}, {"step": 3, "health/skipped": 3}, {"step": 2, "health/rollbacks": 1}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    row = jobs.job_row(0, tmp_path, ["health=strict"])
    assert (row.skipped, row.rollbacks, row.steps) == (3, 1, 4)


def test_an_injected_spike_is_skipped_under_the_skip_action(tmp_path):
    out = train(tmp_path, ["training.steps=6", "health.spike_action=skip", "health.spike_min_history=3",
                           "fault_injection.spike_at_step=5"], "spike")
    assert (out["health"]["spikes"], out["health"]["skipped"], out["steps"]) == (1, 1, 6)
    report = json.loads((tmp_path / "spike/health/rank0.json").read_text())
    [line] = report["event_lines"]
    assert line.startswith("step 5 spike: loss is ") and line.endswith("skipped (optimizer and schedule untouched)")


def test_a_recheck_that_finds_nothing_leaves_the_run_bit_identical(tmp_path):
    accum = ["training.global_batch_size=8"]  # 2 micro-batches per step: both are run again
    checked = train(tmp_path, accum + ["health.recheck_every=1"], "recheck")
    clean = train(tmp_path, accum, "clean")
    assert checked["losses"] == clean["losses"] and checked["health"]["recheck_mismatches"] == 0
    assert_bit_equal(checked["full_state"], clean["full_state"])
    rows = [r for r in read_metrics(tmp_path / "recheck") if "health/recheck_mismatch" in r]
    assert [(r["step"], r["health/recheck_mismatch"]) for r in rows] == [(s, 0) for s in range(1, 5)]


def test_a_gradient_bit_flip_is_named_transient_or_persistent(tmp_path):
    flip = ["health.recheck_every=2", "fault_injection.bitflip_rank=0", "fault_injection.at_step=2"]
    out = train(tmp_path, flip + ["health.recheck_action=continue", "fault_injection.bitflip_target=grad"], "flip")
    [line] = json.loads((tmp_path / "flip/health/rank0.json").read_text())["event_lines"]
    assert line == ("step 2 recheck: the same batch gave other gradients on rank 0 (transient); "
                    "continuing with the agreeing gradients")
    assert out["health"]["recheck_mismatches"] == 1 and out["steps"] == 4
    assert out["losses"] == train(tmp_path, [], "clean")["losses"]  # the agreeing gradients were applied
    with pytest.raises(SilentCorruption, match=r"^step 2 recheck: .* on rank 0 \(persistent\); stopping"):
        train(tmp_path, flip + ["fault_injection.bitflip_target=grad_every_run"], "stop")



class Counting(torch.nn.Linear):
    """A layer whose forward also counts, as an MoE layer counts its experts' load."""

    def __init__(self) -> None:
        super().__init__(3, 2)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


@pytest.mark.parametrize("bad_run, kept_run", [(0, 1), (1, 0)])
def test_the_recheck_keeps_the_agreeing_gradients_and_counts_the_forward_once(bad_run, kept_run):
    """The run that erred (the step's own: 0, or the re-run: 1) is outvoted by the third."""
    torch.manual_seed(0)
    layer, x, grads = Counting(), torch.randn(4, 3), {}

    def rerun():
        layer(x).square().sum().backward()

    def corrupt(step, run, local):
        if run == bad_run:
            local[0].view(-1)[:1].view(torch.int32).bitwise_xor_(1 << 20)
        grads[run] = local[0].clone()

    check = GradRecheck(every=1, action="continue", device=torch.device("cpu"), corrupt=corrupt)
    check.begin_step(1)
    rerun()
    metrics, line = check.check(1, list(layer.parameters()), rerun, list(layer.buffers()))
    assert metrics == {"health/recheck_mismatch": 1.0} and "rank 0 (transient)" in line
    assert not torch.equal(grads[0], grads[1]) and torch.equal(grads[2], grads[kept_run])
    assert torch.equal(layer.weight.grad, grads[kept_run]) and layer.calls.item() == 1


def test_a_recheck_on_gpu_asks_for_deterministic_kernels():
    spec = spec_of(compose_cfg(["health.recheck_every=10"]))
    with pytest.raises(ConfigError, match=r"^health.recheck_every=10 compares gradients bit for bit.*"
                                          r"set training.deterministic=true or health.recheck_every=0"):
        health_of(spec, "", 0, torch.device("cuda"), None, None, None, None, None)
