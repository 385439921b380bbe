"""Against a real single-node SLURM (scripts/slurm/install.sh + start.sh, started here).

(a) a 2-task gloo FSDP job through ``launch.py cluster=slurm_local`` gives the same losses as
    the same layout launched locally; (b) a 2-point multirun becomes one SLURM array and the
    sweep report lists both jobs with the losses they logged; bad input (unknown partition,
    a sweep key that does not exist, no sbatch) fails with one ``error:`` line; (c) corpus
    preparation spread over the tasks of one job gives the corpus one machine makes; (d) torchft
    replica groups as the jobs of a sweep (-m fault_tolerance.group=0,1) meet at a Lighthouse
    run beside them and train as one.
Skipped only when this machine cannot install SLURM (not root, or no apt-get); CI is root.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import BASE, GLOBAL_BATCH, REPO, STEPS, fsdp2_reference, run_launch, series
from slurm_fixtures import slurm  # noqa: F401  (the session fixture)
from titan_hydra.checkpoint.storage import load_plain, read_metadata, tensor_entries
from titan_hydra.data.prepare import PrepareSettings, prepare
from titan_hydra.data.shards import ShardedTokens
from titan_hydra.errors import UserError
from titan_hydra.launch.ft_local import lighthouse_binary
from titan_hydra.launch.slurm import release
from titan_hydra.runtime.rendezvous import free_port


def slurm_run(tmp_path: Path, args: list[str], multirun: bool = False):
    return run_launch((["-m"] if multirun else []) + args, cwd=tmp_path, timeout=600)


@pytest.mark.slow
@pytest.mark.extended
def test_two_task_job_matches_local_run(slurm, tmp_path, run_cache):
    run_dir = tmp_path / "slurm_run"
    proc = slurm_run(tmp_path, BASE + [
        "cluster=slurm_local", "cluster.tasks_per_node=2", "parallelism=fsdp",
        f"training.local_batch_size={GLOBAL_BATCH // 2}", f"hydra.run.dir={run_dir}",
    ])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert "submitted SLURM job" in proc.stdout
    slurm_losses = series(run_dir, "loss")
    local_losses = series(fsdp2_reference(run_cache)[0], "loss")  # the same layout, launched locally
    assert len(slurm_losses) == STEPS
    # the same config, layout, process count and threads on the same machine: the same sums in the
    # same order, so bit for bit (as test_slurm_requeue's requeued job against the same local run)
    diff = max(abs(a - b) for a, b in zip(slurm_losses, local_losses))
    assert diff == 0, f"max |slurm - local| = {diff:.3g}\nslurm: {slurm_losses}\nlocal: {local_losses}"


SWEEP_TINY = [
    "model.dim=64", "model.n_layers=2", "model.n_heads=4", "training.seq_len=64", "training.steps=3",
    "training.local_batch_size=4", "training.val_freq=3", "training.val_steps=1",
    "lr_scheduler.warmup_steps=1", "data.max_documents=60", "cluster.threads_per_proc=1",
]


@pytest.mark.slow
@pytest.mark.extended
def test_multirun_becomes_array_and_report_lists_both(slurm, tmp_path):
    sweep = tmp_path / "sweep"
    proc = slurm_run(tmp_path, ["cluster=slurm_local", *SWEEP_TINY, "optimizer.lr=1e-3,3e-3",
                                f"hydra.sweep.dir={sweep}"], multirun=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert "submitted SLURM array" in proc.stdout
    array_id = proc.stdout.split("submitted SLURM array ")[1].split()[0]
    sacct = subprocess.run(["sacct", "-n", "-X", "-j", array_id, "-o", "JobID,State"],
                           capture_output=True, text=True).stdout.split()
    assert f"{array_id}_0" in sacct and f"{array_id}_1" in sacct, sacct
    scripts = list(sweep.rglob("*submission.sh"))
    assert scripts and all("#SBATCH --hold" in f.read_text() for f in scripts), scripts

    from titan_hydra.analysis import sweep_report

    rows = sweep_report.report(sweep)
    assert [r.job for r in rows] == [0, 1]
    assert [r.status for r in rows] == ["completed", "completed"]
    for row, lr in zip(rows, ("0.001", "0.003")):
        assert f"optimizer.lr={lr}" in row.overrides
        assert row.final_loss == pytest.approx(series(sweep / str(row.job), "loss")[-1], abs=0)
        assert row.val_loss is not None and 0 < row.val_loss < 10
    assert rows[0].final_loss != rows[1].final_loss  # the two learning rates really ran
    text = (sweep / "report.md").read_text()
    assert "2 of 2 jobs completed" in text
    assert (sweep / "loss_curves.png").stat().st_size > 1000


@pytest.mark.slow
def test_unknown_partition_is_one_error(slurm, tmp_path):
    proc = slurm_run(tmp_path, ["cluster=slurm_local", "cluster.partition=nosuch"])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: cluster.partition=nosuch is not a partition")


@pytest.mark.slow
def test_sweep_key_that_does_not_exist_is_one_error(slurm, tmp_path):
    proc = slurm_run(tmp_path, ["cluster=slurm_local", "training.stepz=1,2"], multirun=True)
    # SweepCheckCallback composes every point before the sweeper starts: one line, nothing submitted.
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: sweep point #0 [training.stepz=1]: Could not override 'training.stepz'"), last
    assert "submitted SLURM" not in proc.stdout


@pytest.mark.slow
def test_no_sbatch_on_path_is_one_error(tmp_path):
    proc = run_launch(["cluster=slurm_local"], cwd=tmp_path,
                      env={"PATH": str(tmp_path)})
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: cluster=slurm_local submits to SLURM but 'sbatch' is not on PATH"), last


@pytest.mark.slow
def test_a_failed_release_is_one_line(slurm):
    """Jobs are submitted held and released once submitit made their log folders (an idle SLURM
    22.05 started an array task before its folder existed and killed it; the array test checks
    the hold): a release that fails cancels the job and says so."""
    with pytest.raises(UserError, match=r"^scontrol release 999999 failed .*the job was cancelled"):
        release("999999")


@pytest.mark.slow
def test_master_address_is_the_nodes_slurm_address(slurm):
    """scontrol's NodeAddr for the job's first node, read as SLURM itself reports it (sinfo %o)."""
    from titan_hydra.runtime.rendezvous import master_address, slurm_node_addr

    node = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()
    sinfo_addr = subprocess.run(["sinfo", "-h", "-N", "-n", node, "-o", "%o"], capture_output=True,
                                text=True).stdout.split()
    assert sinfo_addr and slurm_node_addr(node) == sinfo_addr[0]
    assert slurm_node_addr("no-such-node") is None  # scontrol answers "not found"
    assert master_address(node) == node  # the name resolves here: kept, no address swap


def test_job_port_is_below_the_ephemeral_range(tmp_path):
    """Every task of a job (and its requeue) derives the same rendezvous port from the job id, below
    the kernel's ephemeral range, where other connections on the node cannot already hold it."""
    from titan_hydra.launch.slurm import ephemeral_low, port_of

    ports = {port_of(str(job)) for job in range(2000)}
    assert all(20000 <= p < ephemeral_low() for p in ports) and len(ports) > 1500
    assert port_of("4242") == port_of("4242") != port_of("4243")
    narrow = tmp_path / "range"
    narrow.write_text("50000\t60999\n")
    assert ephemeral_low(str(narrow)) == 50000 and ephemeral_low(str(tmp_path / "missing")) == 32768


@pytest.mark.slow
@pytest.mark.extended
def test_torchft_groups_are_the_jobs_of_a_sweep(slurm, tmp_path):
    """One SLURM job per replica group (a 2-point array) around a Lighthouse the user runs: with
    min_replicas=2 every step is both groups' (averaged loss, identical in both logs), and both
    end with the same weights."""
    port = free_port()
    lighthouse = subprocess.Popen([lighthouse_binary(), "--min_replicas", "2", "--join_timeout_ms", "500",
                                   "--bind", f"0.0.0.0:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sweep = tmp_path / "sweep"
    try:
        proc = slurm_run(tmp_path, ["cluster=slurm_local", *SWEEP_TINY, "training.steps=6", "training.log_freq=1",
                                    "fault_tolerance=torchft", "fault_tolerance.min_replicas=2",
                                    f"fault_tolerance.lighthouse=http://127.0.0.1:{port}", "fault_tolerance.group=0,1",
                                    "checkpoint=default", "checkpoint.interval=6", f"hydra.sweep.dir={sweep}"],
                         multirun=True)
    finally:
        lighthouse.kill()
        lighthouse.wait()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert "submitted SLURM array" in proc.stdout
    rows = [[json.loads(line) for line in (sweep / str(job) / "metrics.jsonl").read_text().splitlines()
             if '"loss"' in line] for job in (0, 1)]
    assert [r["step"] for r in rows[0]] == list(range(1, 7))
    assert all(r["ft/participants"] == 2 for r in rows[0] + rows[1])
    assert [r["loss"] for r in rows[0]] == [r["loss"] for r in rows[1]]  # the groups' mean, in both
    paths = [sweep / str(job) / "checkpoint" / "step-6" for job in (0, 1)]
    keys = [k for k in tensor_entries(read_metadata(paths[0])) if k.startswith("model.")]
    a, b = (load_plain(p, keys) for p in paths)
    assert keys and all(np.array_equal(a[k].numpy(), b[k].numpy()) for k in keys)


@pytest.mark.slow
@pytest.mark.extended
def test_corpus_preparation_spreads_over_the_tasks_of_one_job(slurm, tmp_path):
    """recipes/prepare_data.py cluster=slurm_local: 2 tasks split 4 input files and the corpus is
    byte-identical to one made on this machine (shard names carry the file's index)."""
    raw = tmp_path / "raw"
    raw.mkdir()
    words = "tokens from four files prepared by two tasks of one job".split()
    for f in range(4):
        (raw / f"part{f}.jsonl").write_text("".join(
            json.dumps({"text": " ".join(words[(i + f) % len(words):] + words[:i % 5])}) + "\n" for i in range(30)))
    out = tmp_path / "slurm_corpus"
    proc = subprocess.run([sys.executable, str(REPO / "recipes" / "prepare_data.py"), "data=json", f"data.path={raw}",
                           f"out={out}", "cluster=slurm_local", "cluster.tasks_per_node=2", "data.val_fraction=0.1"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "submitted SLURM job" in proc.stdout and "with 2 SLURM task(s) x 1 worker(s)" in proc.stdout, proc.stdout
    here = tmp_path / "here"
    prepare(sorted(str(p) for p in raw.glob("*.jsonl")),
            PrepareSettings(source="json", text_field="text", tokenizer="builtin", val_every=10,
                            shard_tokens=16777216, out=str(here)))
    for split in ("train", "val"):
        assert len(ShardedTokens(out, split)) > 0
        assert np.array_equal(ShardedTokens(out, split)[:], ShardedTokens(here, split)[:]), split
    records = sorted((out / "done").glob("*.json"))
    assert len(records) == 4  # every file has its own record, whichever task did it
