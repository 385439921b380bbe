"""fault_tolerance=torchft on CPU (gloo): replica groups launched by launch.py around a Lighthouse.

(a) fault-free, 2 groups x 1 rank, and 2 groups x fsdp(2), give the losses of DDP over 2 ranks
    (same global batch);
(b) SIGKILL of group 1's rank mid-run: group 0 keeps stepping alone (min_replicas=1), the launcher
    restarts group 1, which receives the live state from group 0 (not from disk) and rejoins; both
    end with identical weights, and the final loss stays near the undisturbed run's;
(c) a Lighthouse nobody answers at is one line, before any group starts;
(d) a group started on its own (fault_tolerance.group) against a running Lighthouse, after the
    other has stepped: it receives the live state and both end with identical weights;
(e) semi-synchronous: DiLoCo with one inner step per meeting, plain SGD inside and an outer SGD
    of lr 1 is data parallelism (weights equal DDP(2)'s); LocalSGD and DiLoCo with their real
    settings train, meet every sync_every steps and end with identical weights, sending one
    model's worth of bytes per meeting.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import REPO, floor_bound, fp32_ulp, launch_here, machine_bound, read_metrics, series
from titan_hydra.checkpoint.storage import load_plain, read_metadata, tensor_entries
from titan_hydra.launch.ft_local import lighthouse_binary
from titan_hydra.metrics.goodput import LEDGER, read_records, tally_of
from titan_hydra.runtime.rendezvous import free_port

STEPS = 24
TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "training.seq_len=64",
        f"training.steps={STEPS}", "training.global_batch_size=8", "training.local_batch_size=4",
        "training.mixed_precision=fp32", "training.val_freq=12", "training.val_steps=2", "data.max_documents=60", "logger=minimal",
        "cluster.threads_per_proc=1", "lr_scheduler.warmup_steps=2",
        # plain SGD: DiLoCo with one inner step and an outer lr of 1 is then exactly DDP, so one DDP
        # run is the reference of every test here (synchronous groups equal DDP with any optimizer)
        "optimizer=sgd", "optimizer.lr=0.5", "checkpoint=default", f"checkpoint.interval={STEPS}",
        "training.log_freq=1"]
FT = ["fault_tolerance=torchft", "fault_tolerance.replica_groups=2", "fault_tolerance.quorum_timeout_s=30",
      "fault_tolerance.timeout_s=30"]


def launch(run_dir: Path, extra: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    return subprocess.Popen([sys.executable, str(REPO / "launch.py"), *TINY, *extra, f"hydra.run.dir={run_dir}"],
                            cwd=run_dir.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def steps_of(run_dir: Path) -> list[dict]:
    """The step rows (those with a loss) a group logged, in order ([] before its first)."""
    return [r for r in read_metrics(run_dir, missing_ok=True) if "loss" in r]


def weights_at(run_dir: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    """The model entries of the group's checkpoint at ``step``."""
    path = run_dir / "checkpoint" / f"step-{step}"
    return load_plain(path, [k for k in tensor_entries(read_metadata(path)) if k.startswith("model.")])


def finish(proc: subprocess.Popen, timeout: int = 300) -> tuple[str, str]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-3000:]}\n{err[-4000:]}"
    return out, err


@pytest.fixture(scope="module")
def ddp_dir(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ddp") / "run"
    launch_here([*TINY, "parallelism=ddp", "cluster.nproc_per_node=2"], run_dir)
    return run_dir


@pytest.fixture(scope="module")
def single_dir(tmp_path_factory):
    """DDP's run in one process (batch 8 at once): its weights differ from DDP's by another
    summation order of the gradients only, the floor of a weight comparison here."""
    run_dir = tmp_path_factory.mktemp("single") / "run"
    launch_here([*TINY, "parallelism=single", "cluster.nproc_per_node=1", "training.local_batch_size=8"], run_dir)
    return run_dir


@pytest.mark.slow
def test_two_replica_groups_match_ddp(tmp_path, ddp_dir, run_cache):
    ddp = series(ddp_dir, "loss")
    run_dir = tmp_path / "run"
    out, _ = finish(launch(run_dir, [*FT, "fault_tolerance.min_replicas=2"]))
    assert "torchft replica group 0 of 2" in out
    losses = series(run_dir, "loss")
    assert len(losses) == len(ddp) == STEPS
    diff = max(abs(a - b) for a, b in zip(losses, ddp))
    assert diff <= machine_bound(run_cache, ddp), f"max |torchft - ddp| = {diff:.3g}\ntorchft: {losses}\nddp: {ddp}"
    # group 1 ran in its own run dir and logged the same (averaged) losses
    assert series(run_dir / "replica_groups" / "1", "loss") == losses
    # each group validates on every group's slice: DDP's validation loss, in both groups
    val, ddp_val = series(run_dir, "val/loss"), series(ddp_dir, "val/loss")
    assert len(val) == len(ddp_val) == 2, (val, ddp_val)
    assert max(abs(a - b) for a, b in zip(val, ddp_val)) <= machine_bound(run_cache, ddp_val), (val, ddp_val)
    assert series(run_dir / "replica_groups" / "1", "val/loss") == val


# fsdp: DTensor gradient shards averaged as local tensors. Checked by hand against DDP(2), not
# here for CI time (~30 s each): tp and ep (the same path, 1e-6 / 3e-6) and pp (each rank holds
# other parameters and meets the same stage of the other group, 9.5e-7); docs/reference.md.
@pytest.mark.parametrize("layout", ["fsdp"])
@pytest.mark.slow
@pytest.mark.extended
def test_groups_with_a_layout_inside_match_ddp(tmp_path, ddp_dir, run_cache, layout):
    """2 groups x <layout>(2): each group splits its model over its own 2 ranks, and each rank
    averages its own gradient shards with the same rank of the other group (a pp stage with the
    same stage); the same global batch gives DDP(2)'s (and HSDP(2x2)'s) losses."""
    run_dir = tmp_path / "run"
    local = ["training.local_batch_size=2"] if layout == "fsdp" else []  # fsdp splits the batch, tp/pp do not
    out, _ = finish(launch(run_dir, [*FT, "fault_tolerance.min_replicas=2", f"parallelism={layout}",
                                     "cluster.nproc_per_node=2", *local]))
    assert "torchft replica group 0 of 2" in out
    for key in ("loss", "val/loss"):
        got, want = series(run_dir, key), series(ddp_dir, key)
        diff = max(abs(a - b) for a, b in zip(got, want))
        assert len(got) == len(want) and diff <= machine_bound(run_cache, want), (
            f"{key}: max |torchft x {layout} - ddp| = {diff:.3g}")


RAMP = ["training.steps=8", "checkpoint.interval=8", "training.global_batch_size=-1",
        "training.batch_schedule=[[0,8],[1536,16]]"]  # 3 steps of 8 sequences, then 16: 2 micro-batches a rank


@pytest.mark.slow
@pytest.mark.extended
def test_groups_follow_a_batch_ramp_like_ddp(tmp_path, run_cache):
    """Under a batch schedule each group draws the step's micro-batches like every other layout: 2 groups x 1
    rank through a ramp 8 -> 16 give DDP(2)'s losses on the same ramp (batch_size logged alike)."""
    ddp_dir = tmp_path / "ddp"
    launch_here([*TINY, *RAMP, "parallelism=ddp", "cluster.nproc_per_node=2"], ddp_dir)
    run_dir = tmp_path / "run"
    finish(launch(run_dir, [*FT, *RAMP, "fault_tolerance.min_replicas=2"]))
    assert series(run_dir, "batch_size") == series(ddp_dir, "batch_size") == [8.0] * 3 + [16.0] * 5
    got, want = series(run_dir, "loss"), series(ddp_dir, "loss")
    diff = max(abs(a - b) for a, b in zip(got, want))
    assert len(got) == len(want) == 8 and diff <= machine_bound(run_cache, want), (
        f"max |torchft - ddp| through the ramp = {diff:.3g}\ntorchft: {got}\nddp: {want}")


def _steps_together(run_dir: Path) -> int:
    """The last step ``run_dir``'s group logged with both groups in the quorum (0: none yet)."""
    return max((r["step"] for r in steps_of(run_dir) if r.get("ft/participants") == 2), default=0)


@pytest.mark.slow
def test_a_killed_group_restarts_recovers_from_its_peer_and_rejoins(tmp_path, ddp_dir):
    ddp = series(ddp_dir, "loss")
    run_dir = tmp_path / "run"
    group1 = run_dir / "replica_groups" / "1"
    proc = launch(run_dir, [*FT, "fault_tolerance.min_replicas=1"])
    deadline = time.time() + 120
    # kill group 1 a few steps after both groups train together (the first to start trains alone)
    while _steps_together(group1) < 4:
        assert proc.poll() is None and time.time() < deadline, "the groups never trained together for 4 steps"
        time.sleep(0.02)
    pid = subprocess.run(["pgrep", "-f", f"hydra.run.dir={group1}"], capture_output=True, text=True).stdout.split()
    assert len(pid) == 1, pid
    killed_at = _steps_together(group1)
    os.kill(int(pid[0]), signal.SIGKILL)
    # group 0 steps on alone (~40 ms a step here) while group 1 restarts (seconds): once it has
    # stepped alone, hold it until the new group 1 has built its model, so that it is still
    # running when group 1 asks to rejoin
    while '"ft/participants": 1.0' not in (run_dir / "metrics.jsonl").read_text():
        assert proc.poll() is None and time.time() < deadline, "group 0 did not step on alone"
        time.sleep(0.01)
    group0 = subprocess.run(["pgrep", "-P", str(proc.pid), "-f", f"hydra.run.dir={run_dir}$"], capture_output=True,
                            text=True).stdout.split()  # the launcher's child for group 0, not the launcher
    assert len(group0) == 1, group0
    os.kill(int(group0[0]), signal.SIGSTOP)
    try:
        while (group1 / "group.log").read_text().count("titan_hydra run") < 2:
            assert proc.poll() is None and time.time() < deadline, "group 1 was not restarted"
            time.sleep(0.05)
    finally:
        os.kill(int(group0[0]), signal.SIGCONT)
    out, _ = finish(proc)
    assert "replica group 1 exited with -9; restart 1/3" in out
    assert "replica group 0 exited" not in out  # the survivor was never restarted
    steps0 = steps_of(run_dir)
    assert [m["step"] for m in steps0] == list(range(1, STEPS + 1))  # every step, none lost or repeated
    alone = [m["step"] for m in steps0 if m["ft/participants"] == 1]
    assert alone and min(alone) > killed_at - 2, (alone, killed_at)  # it went on alone after the kill
    rejoined = [r for r in steps_of(group1) if r["ft/recoveries"] == 1]
    assert rejoined, "the restarted group 1 did not recover from a peer"
    assert steps0[-1]["ft/participants"] == 2  # and both finished together
    # group 0's ledger: a step torchft dropped when group 1 died is lost to that failure, not a health skip
    totals = tally_of(read_records(run_dir / LEDGER)[0]).totals
    assert totals.get("health", 0.0) == 0.0, totals
    assert (totals.get("lost", 0.0) > 0) == (steps0[-1]["ft/dropped"] > 0), (totals, steps0[-1]["ft/dropped"])
    # both groups hold the same final weights (their own last checkpoints)
    a, b = weights_at(run_dir), weights_at(group1)
    assert a and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # group 0 trained on half the data for a few steps: near, not equal to, the undisturbed run
    assert abs(steps0[-1]["loss"] - ddp[-1]) < 0.05, (steps0[-1]["loss"], ddp[-1])


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys() and a
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.slow
@pytest.mark.extended
def test_diloco_with_one_inner_step_and_outer_lr_1_is_data_parallel(tmp_path, ddp_dir, single_dir, run_cache,
                                                                   record_property):
    """pseudo-gradient = lr x own gradient; averaged and applied with outer SGD(lr 1) = one DDP
    SGD step. Each group logs its own loss: their mean is DDP's global loss.

    The weights: a pseudo-gradient is old - new weight, the own step rounded to the weights' grid
    (up to half an ulp of the weight, where DDP rounds lr x gradient only once it is added), and
    the outer step rounds once more: up to one fp32 ulp of the largest weight per step, STEPS
    steps, on top of what rounding moves the weights by anyway (``floor_bound`` of the distance
    between DDP and its one-process run)."""
    ft_dir = tmp_path / "ft"
    out, _ = finish(launch(ft_dir, [*FT, "fault_tolerance.min_replicas=2", "fault_tolerance.semi_sync=diloco",
                                    "fault_tolerance.sync_every=1", "fault_tolerance.outer_lr=1",
                                    "fault_tolerance.outer_momentum=0", "fault_tolerance.outer_nesterov=false"]))
    assert "diloco every 1 steps" in out
    rows = steps_of(ft_dir)
    params = sum(t.numel() for t in weights_at(ft_dir).values())
    assert [r["ft/syncs"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[-1]["ft/sent_mb"] == pytest.approx(STEPS * params * 4 / 2**20)  # one pseudo-gradient per meeting
    ddp_weights = weights_at(ddp_dir)
    largest = max(float(w.abs().max()) for w in ddp_weights.values())
    bound = floor_bound(_max_diff(weights_at(single_dir), ddp_weights), [largest]) + STEPS * fp32_ulp(largest)
    diff = _max_diff(weights_at(ft_dir), ddp_weights)
    record_property("max |diloco(H=1) - ddp| weight", diff)
    record_property("bound", bound)
    assert diff <= bound, f"max |diloco(H=1) - ddp| weight = {diff:.3g} > {bound:.3g}"
    assert _max_diff(weights_at(ft_dir), weights_at(ft_dir / "replica_groups" / "1")) == 0
    mean = [(a + b) / 2 for a, b in zip(series(ft_dir, "loss"), series(ft_dir / "replica_groups" / "1", "loss"))]
    ddp = series(ddp_dir, "loss")
    assert len(mean) == len(ddp) == STEPS and max(abs(a - b) for a, b in zip(mean, ddp)) <= machine_bound(run_cache, ddp)


@pytest.mark.slow
@pytest.mark.extended
def test_semi_synchronous_groups_meet_every_sync_every_steps(tmp_path):
    """LocalSGD every 4 steps (DiLoCo's meetings are the same hooks: its parity test above checks
    its bytes and meetings too)."""
    method = "local_sgd"
    run_dir = tmp_path / "run"
    finish(launch(run_dir, [*FT, "fault_tolerance.min_replicas=2", f"fault_tolerance.semi_sync={method}",
                            "fault_tolerance.sync_every=4", "optimizer=adamw", "optimizer.lr=4e-3"]))
    rows = steps_of(run_dir)
    assert [r["ft/syncs"] for r in rows] == [s // 4 for s in range(1, STEPS + 1)]  # a meeting after every 4th step
    losses = [r["loss"] for r in rows]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.5, losses  # it trains
    # between meetings nothing is sent; at each, every weight once (fp32)
    params = sum(t.numel() for t in weights_at(run_dir).values())
    assert rows[-1]["ft/sent_mb"] == pytest.approx(STEPS // 4 * params * 4 / 2**20)
    assert rows[5]["ft/sent_mb"] == rows[4]["ft/sent_mb"] == rows[3]["ft/sent_mb"] > 0
    # the last step was a meeting: both groups hold the same weights
    assert _max_diff(weights_at(run_dir), weights_at(run_dir / "replica_groups" / "1")) == 0


@pytest.mark.slow
@pytest.mark.extended
def test_a_group_started_on_its_own_joins_late_and_heals(tmp_path):
    """Two launches of one group each (as on two machines or two SLURM jobs) and a Lighthouse the
    user runs: group 1 starts after group 0 has stepped alone, receives its live state, and both
    finish with the same weights; group 0's quorum changed when group 1 joined."""
    port = free_port()
    lighthouse = subprocess.Popen([lighthouse_binary(), "--min_replicas", "1", "--quorum_tick_ms", "100",
                                   "--join_timeout_ms", "500", "--bind", f"127.0.0.1:{port}"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    steps = 48
    own = [*FT, "fault_tolerance.min_replicas=1", f"fault_tolerance.lighthouse=http://127.0.0.1:{port}",
           f"training.steps={steps}", "checkpoint=default", f"checkpoint.interval={steps}", "training.log_freq=1"]
    try:
        first = launch(tmp_path / "g0", [*own, "fault_tolerance.group=0"])
        deadline = time.time() + 120
        while len(steps_of(tmp_path / "g0")) < 3:
            assert first.poll() is None and time.time() < deadline, "group 0 never stepped"
            time.sleep(0.02)
        # group 0 steps alone in ~40 ms, group 1 needs seconds to start: hold group 0 until group 1
        # has built its model (its header), so that it is still running when group 1 comes
        os.kill(first.pid, signal.SIGSTOP)
        try:
            second = launch(tmp_path / "g1", [*own, "fault_tolerance.group=1"])
            for line in second.stdout:
                if line.startswith("titan_hydra run"):
                    break
        finally:
            os.kill(first.pid, signal.SIGCONT)
        finish(first)
        finish(second)
    finally:
        lighthouse.kill()
        lighthouse.wait()
    rows0, rows1 = steps_of(tmp_path / "g0"), steps_of(tmp_path / "g1")
    assert [r["step"] for r in rows0] == list(range(1, steps + 1))
    assert rows0[0]["ft/participants"] == 1 and rows0[-1]["ft/participants"] == 2
    assert rows0[-1]["ft/quorums"] >= 2  # alone, then with group 1
    assert rows1[-1]["ft/recoveries"] == 1 and rows1[-1]["step"] == steps  # healed once, from group 0's state
    a, b = weights_at(tmp_path / "g0", steps), weights_at(tmp_path / "g1", steps)
    assert a and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.AdamW])
def test_reading_the_live_state_changes_nothing_mid_step(optimizer):
    """torchft reads a group's state from its quorum thread while the training thread is between
    forward and backward. With a stateless SGD (or any optimizer before its first step) torch's
    optimizer state-dict reader used to run a zero-lr step on zero gradients: the parameters'
    versions moved (CI: "modified by an inplace operation" in the backward) and gradients were lost."""
    from titan_hydra.checkpoint.live import live_state_fns
    from titan_hydra.checkpoint.state import RunParts
    from titan_hydra.train.trainer import TrainState

    model = torch.nn.Linear(4, 4)
    opt = optimizer(model.parameters(), lr=0.1)
    run = RunParts(model_parts=[model], optimizer=opt, lr_scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                   train_loader=None, train_state=TrainState(), dims=None, family=None, model_args=None, flavor="x")
    state_dict, _ = live_state_fns(run)
    loss = model(torch.ones(2, 4)).square().sum()  # the graph saves the weight (version checked in backward)
    versions = [p._version for p in model.parameters()]
    sd = state_dict()
    assert [p._version for p in model.parameters()] == versions and all(p.grad is None for p in model.parameters())
    loss.backward()  # would raise if the read had stepped the optimizer
    assert sd["optim"] == {} and set(sd["model"]) == {"weight", "bias"}


@pytest.mark.slow
def test_an_unreachable_lighthouse_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "launch.py"), *TINY, *FT,
                           "fault_tolerance.lighthouse=http://127.0.0.1:9", f"hydra.run.dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: cannot reach the torchft Lighthouse at http://127.0.0.1:9"), last
