"""A rank that cannot meet its peers fails within ``cluster.init_timeout_s`` with one line naming
the address it tried, instead of sitting in torch's 30-minute rendezvous retry loop.

Each case runs ``launch.py`` as one rank of a 2-rank job (the environment torchrun or SLURM would
give it) with nobody else coming; the three run side by side to keep the module short. Plus the
SLURM ``NodeAddr`` parsing, and the collectives' timeout after a bounded init.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta

import pytest
from helpers import REPO, free_port

from titan_hydra.runtime.rendezvous import master_address, node_addr_of

TIMEOUT_S = 5
ARGS = ["parallelism=fsdp", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "training.seq_len=64",
        "training.steps=1", "training.local_batch_size=2", "logger=minimal", "cluster.threads_per_proc=1",
        f"cluster.init_timeout_s={TIMEOUT_S}"]


def start_rank(rank: int, master: str, port: int, run_dir) -> tuple[subprocess.Popen, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", "RANK": str(rank), "LOCAL_RANK": "0",
           "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": master, "MASTER_PORT": str(port)}
    proc = subprocess.Popen([sys.executable, str(REPO / "launch.py"), *ARGS, f"hydra.run.dir={run_dir}"],
                            cwd=run_dir.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, time.monotonic()


@pytest.mark.slow
def test_unreachable_rendezvous_is_one_line_within_the_timeout(tmp_path):
    dead_port, lonely_port, port = free_port(), free_port(), free_port()
    cases = {
        # a first node whose name does not resolve: fails before waiting at all
        "unresolvable": start_rank(1, "no-such-node.invalid", port, tmp_path / "a"),
        # a resolvable address where nothing listens: fails after init_timeout_s
        "dead": start_rank(1, "127.0.0.1", dead_port, tmp_path / "b"),
        # rank 0 itself, whose peer never arrives: fails after init_timeout_s
        "alone": start_rank(0, "127.0.0.1", lonely_port, tmp_path / "c"),
    }
    results = {}
    for name, (proc, started) in cases.items():
        out, err = proc.communicate(timeout=240)
        results[name] = (proc.returncode, err, time.monotonic() - started)
    for name, (code, err, _) in results.items():
        assert code == 2, f"{name}: exit {code}\n{err[-3000:]}"
        assert "Traceback" not in err and "frame #" not in err, f"{name}:\n{err[-3000:]}"

    code, err, elapsed = results["unresolvable"]
    assert err.strip().splitlines()[-1].startswith(
        f"error: cannot reach rendezvous at no-such-node.invalid:{port}: the host name does not resolve"), err
    code, err, dead_elapsed = results["dead"]
    assert err.strip().splitlines()[-1].startswith(
        f"error: cannot reach rendezvous at 127.0.0.1:{dead_port} within {TIMEOUT_S}s (Connection refused)"), err
    code, err, alone_elapsed = results["alone"]
    assert err.strip().splitlines()[-1].startswith(
        f"error: rendezvous at 127.0.0.1:{lonely_port}: only 1 of 2 ranks arrived within {TIMEOUT_S}s"), err
    # The waiting ones waited the timeout (they started alike; the unresolvable one did not wait),
    # and nobody waited torch's 30 minutes or cluster.init_timeout_s's default of 300 s.
    for waited in (dead_elapsed, alone_elapsed):
        assert waited >= TIMEOUT_S and waited < 120, (elapsed, dead_elapsed, alone_elapsed)


def test_collectives_keep_the_default_timeout_after_a_bounded_init(monkeypatch):
    """init_timeout_s bounds the meeting only: a later collective may wait torch's usual 30 min
    (a rank-0-only export longer than 5 minutes must not kill its peers)."""
    import torch
    import torch.distributed as dist

    from titan_hydra.runtime.rendezvous import init_process_group

    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost",
                       "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    init_process_group("gloo", 5)
    try:
        assert os.environ["MASTER_ADDR"] == "127.0.0.1"  # resolved once, IPv4 first
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        assert backend.options._timeout == timedelta(minutes=30)
    finally:
        dist.destroy_process_group()


SCONTROL_SHOW_NODE = """\
NodeName=gpu-a017 Arch=x86_64 CoresPerSocket=32
   CPUAlloc=0 CPUEfctv=64 CPUTot=64 CPULoad=0.42
   AvailableFeatures=h100
   NodeAddr=10.12.3.17 NodeHostName=gpu-a017 Version=23.02.7
   OS=Linux 5.15.0-105-generic #115-Ubuntu SMP
   RealMemory=1000000 AllocMem=0 FreeMem=983210 Sockets=2 Boards=1
   State=IDLE ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A
"""


def test_node_addr_parsing():
    assert node_addr_of(SCONTROL_SHOW_NODE) == "10.12.3.17"
    assert node_addr_of(SCONTROL_SHOW_NODE.replace("NodeAddr=10.12.3.17 ", "")) is None
    assert node_addr_of("") is None


def test_master_address_keeps_a_name_that_resolves():
    assert master_address("localhost") == "localhost"  # resolves: no call to slurmctld
